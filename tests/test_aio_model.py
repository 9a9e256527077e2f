"""Random sequences of sync/async reads and writes, whole-file writes and
truncations, on every backend and many handle settings, agree byte for byte
with an in-memory model of the file (tests/io_model.py)."""

import uuid

from hypothesis import HealthCheck, given, settings

from io_model import handle_settings, run_sequence, sequences


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=handle_settings, seq=sequences)
def test_random_io_sequences_match_the_model(nvme_dir, cfg, seq):
    path = nvme_dir / f"m_{uuid.uuid4().hex}.bin"
    out = run_sequence(cfg, seq, str(path))
    assert out.bytes_lost == 0, out.first_difference
    assert out.ops == len(seq)
    path.unlink()
