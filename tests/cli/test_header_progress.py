"""fit and diff count their header reads against the listing (issue 54, item 7): `reading headers (files)` with
done/total from the first frame, never an open-ended `0/?`."""

from __future__ import annotations

import pytest

from helpers import many_findings_checkpoint, run_cli


@pytest.mark.parametrize("command", ["fit", "diff"])
def test_fit_and_diff_count_their_headers(capsys, tmp_path, terminal, command):
    source = many_findings_checkpoint(tmp_path / "zeros")
    argv = ["fit", str(source), "--tp", "2", "--gpu", "rtx-pro-6000"] if command == "fit" else \
        ["diff", str(source), str(source)]
    code, _, err = run_cli(capsys, *argv)
    assert code in (0, 1), err
    drawn = terminal.getvalue()
    assert command == "fit" or f"reading headers of local directory {source}" in err + drawn
    assert "reading headers (files)" in drawn and "0/5" in drawn and "5/5" in drawn  # 4 layers, other weights
    header_lines = [line for line in drawn.split("\n") if "reading headers" in line]
    assert header_lines and not any("0/?" in line for line in header_lines)
