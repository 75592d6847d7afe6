#!/usr/bin/env python3
"""The slowest tests of a `.ci/run`, from nextest's JUnit reports (.config/nextest.toml).

    ci-slowest.py collect STAGE LOG JUNIT...   append each test's seconds, tagged with STAGE, to LOG
    ci-slowest.py print N LOG                  print the N slowest as a Markdown table
"""
import sys
import xml.etree.ElementTree as ET


def collect(stage, log, reports):
    with open(log, "a") as out:
        for report in reports:
            for case in ET.parse(report).iter("testcase"):
                name = f"{case.get('classname', '')} {case.get('name', '')}".strip()
                out.write(f"{float(case.get('time', 0)):.1f}\t{stage}\t{name}\n")


def show(n, log):
    try:
        rows = [line.rstrip("\n").split("\t") for line in open(log)]
    except FileNotFoundError:
        rows = []
    rows.sort(key=lambda r: -float(r[0]))
    print(f"\n| the {n} slowest tests | stage | seconds |\n|---|---|---:|")
    for secs, stage, name in rows[:n]:
        print(f"| {name} | {stage} | {secs} |")
    print(f"({len(rows)} test runs in all, {sum(float(r[0]) for r in rows):.0f} s of test time)")


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        collect(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        show(int(sys.argv[2]), sys.argv[3])
