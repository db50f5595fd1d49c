#!/usr/bin/env python3
"""Checks what a measuring script printed, for its smoke run (`benches/run.sh --smoke`).

Reads the script's output on stdin, passes it through to stdout, and exits 1 (saying why
on stderr) unless:

- it holds at least `--tables N` Markdown tables (default 1), each with at least one row,
  every row with as many cells as its header;
- every cell holds something, except in the columns named with `--may-be-empty`
  (repeatable);
- no figure is NaN or infinite;
- with `--lines N --pattern REGEX` (for a script that prints lines, not tables): at least
  N lines match REGEX, and no number in them is NaN or infinite.

    SMOKE=1 benches/catalog.sh sqlite | benches/check-tables.py --tables 1
"""

import argparse
import re
import sys

NOT_FINITE = re.compile(r"(?<![A-Za-z])(nan|inf|infinity)(?![A-Za-z])", re.IGNORECASE)


def cells(line):
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(lines):
    """The Markdown tables in `lines`: (header, rows) each."""
    found, current = [], None
    for line in lines:
        if line.lstrip().startswith("|"):
            row = cells(line)
            if current is None:
                current = (row, [])
                found.append(current)
            elif all(re.fullmatch(r":?-+:?", cell) for cell in row):
                continue
            else:
                current[1].append(row)
        else:
            current = None
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", type=int, default=1)
    parser.add_argument("--may-be-empty", action="append", default=[])
    parser.add_argument("--lines", type=int, default=0)
    parser.add_argument("--pattern")
    args = parser.parse_args()
    text = sys.stdin.read()
    sys.stdout.write(text)
    sys.stdout.flush()
    lines = text.splitlines()
    problems = []
    if args.lines:
        matching = [line for line in lines if re.search(args.pattern, line)]
        if len(matching) < args.lines:
            problems.append(f"{len(matching)} lines match {args.pattern!r}, expected {args.lines}")
        problems += [f"not finite: {line}" for line in matching if NOT_FINITE.search(line)]
    else:
        found = tables(lines)
        if len(found) < args.tables:
            problems.append(f"{len(found)} tables, expected {args.tables}")
        for header, rows in found:
            if not rows:
                problems.append(f"a table without rows: | {' | '.join(header)} |")
            for row in rows:
                where = f"| {' | '.join(row)} |"
                if len(row) != len(header):
                    problems.append(f"{len(row)} cells under {len(header)} columns: {where}")
                    continue
                for column, cell in zip(header, row):
                    if not cell and column not in args.may_be_empty:
                        problems.append(f"no figure under {column!r}: {where}")
                    elif NOT_FINITE.search(cell):
                        problems.append(f"not finite under {column!r}: {where}")
    if problems:
        print("smoke check failed:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
