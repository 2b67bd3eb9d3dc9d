"""The API's shared parts: errors, tenancy, idempotency keys, pagination, schema, base views."""
