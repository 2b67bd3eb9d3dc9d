"""Top frames of a py-spy profile (collapsed stacks, ``py-spy record --format raw``) and a flame graph.

    .venv/bin/python bench/profile_top.py bench/out/profile-scale-postgres.folded \\
        [--under 'drain \\(.*jobs/tasks.py\\)'] [--top 25] [--svg bench/out/profile.svg]

Cumulative % of a frame: the samples whose stack holds it (once per stack), over the samples
kept: every sample, or with ``--under REGEX`` those whose stack holds a frame matching REGEX
(e.g. the queue's ``drain`` or the run engine's ``_step``), so the figures are shares of that
path's time. Self %: the samples where the frame is the innermost one. Recorded with ``--idle``,
time a worker waits (for the database, the broker) counts, under the frame that waits.
``--svg`` draws the kept stacks as a flame graph (hover a box for its frame and share).
"""

from __future__ import annotations

import argparse
import html
import re
from collections import Counter
from pathlib import Path


def read(path: Path, under: str | None) -> list[tuple[list[str], int]]:
    pattern = re.compile(under) if under else None
    stacks = []
    for line in path.read_text().splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        frames = body.split(";")
        if pattern:
            index = next((i for i, frame in enumerate(frames) if pattern.search(frame)), None)
            if index is None:
                continue
            frames = frames[index:]  # from the matching frame in
        stacks.append((frames, int(count)))
    return stacks


def short(frame: str) -> str:
    """``name (path/to/file.py)`` with site-packages and the project's directory cut off."""
    frame = re.sub(r"\(.*?site-packages/", "(", frame)
    return re.sub(r"\(/[^)]*?/((?:jobs|runs|core|billing|bench|django_q|diagnosis)/)", r"(\1", frame)


def tables(stacks, top: int) -> str:
    total = sum(count for _, count in stacks) or 1
    cumulative: Counter = Counter()
    own: Counter = Counter()
    for frames, count in stacks:
        for frame in set(frames):
            cumulative[short(frame)] += count
        own[short(frames[-1])] += count
    lines = [f"{total} samples", "", f"{'cumulative %':>12}  frame"]
    lines += [f"{100 * n / total:12.1f}  {frame}" for frame, n in cumulative.most_common(top)]
    lines += ["", f"{'self %':>12}  frame"]
    lines += [f"{100 * n / total:12.1f}  {frame}" for frame, n in own.most_common(top)]
    return "\n".join(lines)


def svg(stacks, path: Path, title: str) -> None:
    tree: dict = {"n": 0, "kids": {}}
    for frames, count in stacks:
        node = tree
        node["n"] += count
        for frame in frames:
            node = node["kids"].setdefault(short(frame), {"n": 0, "kids": {}})
            node["n"] += count
    width, row = 1600.0, 16
    total = tree["n"] or 1
    boxes = []

    def depth(node) -> int:
        return 1 + max((depth(kid) for kid in node["kids"].values()), default=0)

    height = (depth(tree) + 2) * row

    def draw(node, x: float, level: int) -> None:
        for name, kid in sorted(node["kids"].items()):
            w = width * kid["n"] / total
            if w >= 0.5:
                y = height - (level + 2) * row
                share = 100 * kid["n"] / total
                hue = 20 + (hash(name) % 40)
                label = html.escape(name[: int(w / 7)]) if w > 21 else ""
                boxes.append(f'<g><title>{html.escape(name)} ({share:.1f} %)</title>'
                             f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
                             f'fill="hsl({hue},85%,60%)"/><text x="{x + 2:.1f}" y="{y + row - 4}">{label}</text></g>')
                draw(kid, x, level + 1)
            x += w

    draw(tree, 0.0, 0)
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'font-family="monospace" font-size="11"><text x="4" y="14">{html.escape(title)}</text>'
        + "".join(boxes) + "</svg>\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folded", type=Path)
    parser.add_argument("--under", help="keep only stacks through a frame matching this regular expression")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--svg", type=Path, help="write a flame graph of the kept stacks here")
    args = parser.parse_args()
    stacks = read(args.folded, args.under)
    if not stacks:
        raise SystemExit(f"no samples{' under ' + args.under if args.under else ''} in {args.folded}")
    print(tables(stacks, args.top))
    if args.svg:
        svg(stacks, args.svg, f"{args.folded.name}{' under ' + args.under if args.under else ''}")


if __name__ == "__main__":
    main()
