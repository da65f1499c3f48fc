"""bench/gpu_decode.py's bookkeeping: each contender's figure, or its error, recorded at
once, so one failure (an out-of-memory stack, a library's missing keyword) loses that
figure alone and a run cut short keeps what it measured."""

from gpu_decode import measure


def test_a_contender_that_fails_leaves_its_error_and_the_row_is_recorded_each_time():
    recorded: list[dict] = []
    row: dict = {"point": "llama-3.2-1b/bfloat16/b64/c2048"}
    measure(row, "engine_tok_s", lambda r: recorded.append(dict(r)), lambda a, b=0: a + b, 40, b=2)

    def out_of_memory() -> float:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    measure(row, "stack_mb2_aw1_tok_s", lambda r: recorded.append(dict(r)), out_of_memory)
    assert row["engine_tok_s"] == 42 and "stack_mb2_aw1_tok_s" not in row
    assert row["stack_mb2_aw1_tok_s_error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert recorded == [{"point": row["point"], "engine_tok_s": 42}, row]
