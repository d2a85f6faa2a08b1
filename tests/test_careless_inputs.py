"""Careless inputs and full disks that ended in a traceback or in misleading advice: each is
one line naming the value or file and the fix, found before any work where it can be (issue
49, round three). The helpers are ``test_errors``'."""

from reference import tiny_flags
from test_errors import one_line_error


def test_a_full_run_directory_is_one_line_naming_metrics_jsonl(tmp_path, capsys, tmpfs):
    """ENOSPC appending a step record: two tracebacks (the write's, then the close's), no file named."""
    full = tmpfs("full", 16)
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--train.run_dir={full / 'run'}", steps=40)], 1)
    assert f"writing the step records to {full / 'run' / 'metrics.jsonl'} failed: No space left on device" in line
    assert "free space on its filesystem or give the run another --train.run_dir" in line
