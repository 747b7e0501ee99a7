"""The doctor's report as a compact table, with the fix of every check that did not pass below it."""

from __future__ import annotations

import shutil
import textwrap

from hybrid_transfer.doctor.types import DoctorReport, Status


def render(report: DoctorReport, width: int | None = None) -> str:
    """A compact table (check, status, detail) and, below it, the fix of every check that did not pass."""
    width = width or max(80, min(shutil.get_terminal_size((120, 24)).columns, 160))
    name_w = max(len("check"), *(len(c.name) for c in report.checks))
    status_w = len("status")
    detail_w = max(30, width - name_w - status_w - 4)
    lines = [f"{'check'.ljust(name_w)}  {'status'.ljust(status_w)}  detail",
             f"{'-' * name_w}  {'-' * status_w}  {'-' * min(detail_w, 40)}"]
    for check in report.checks:
        wrapped = textwrap.wrap(check.detail, detail_w) or [""]
        lines.append(f"{check.name.ljust(name_w)}  {check.status.value.upper().ljust(status_w)}  {wrapped[0]}")
        lines.extend(f"{'':{name_w}}  {'':{status_w}}  {more}" for more in wrapped[1:])
    fixes = [c for c in report.checks if c.status is not Status.PASS and c.fix]
    if fixes:
        lines += ["", "fixes:"]
        for check in fixes:
            wrapped = textwrap.wrap(check.fix, width - 4 - len(check.name)) or [""]
            lines.append(f"  {check.name}: {wrapped[0]}")
            lines.extend(f"  {'':{len(check.name)}}  {more}" for more in wrapped[1:])
    failed = sum(c.status is Status.FAIL for c in report.checks)
    warned = sum(c.status is Status.WARN for c in report.checks)
    lines += ["", "ok" if report.ok else f"{failed} check(s) failed" + (f", {warned} warning(s)" if warned else "")]
    if report.ok and warned:
        lines[-1] = f"ok, {warned} warning(s)"
    return "\n".join(lines)
