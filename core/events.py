"""The events ``core`` writes (see ``core.asyncapi``)."""

from core.asyncapi import STRING, EventMessage

EVENT_MESSAGES = [
    EventMessage(types=("project_created",), summary="A project was created in an organization",
                 properties={"name": STRING}, required=("name",)),
]
