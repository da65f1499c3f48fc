"""bench/engine_throughput.py's transformers batching: every request in exactly one batch,
in order of output length, and each request's own tokens counted. The timed runs load two
models and take minutes; they are the benchmark's, not this test's."""

# bench/engine_throughput.py (bench/ is on the tests' path: pyproject.toml)
from engine_throughput import hf_batches, same_tokens


def test_batches_hold_every_request_once_in_order_of_output_length():
    outs = [5, 1, 3, 1, 9]
    assert hf_batches(outs, 2) == [[1, 3], [2, 0], [4]]
    assert hf_batches(outs, len(outs)) == [[1, 3, 2, 0, 4]]  # the engine's batch: all at once
    assert hf_batches(outs, 64) == [[1, 3, 2, 0, 4]]


def test_same_tokens_counts_requests_equal_in_both_runs():
    assert same_tokens([[1, 2], [3], [4, 5]], [[1, 2], [3, 0], [4, 5]]) == 2
