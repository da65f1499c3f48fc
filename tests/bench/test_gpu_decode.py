"""bench/gpu_decode.py's bookkeeping: each contender's figure, or its error, recorded at
once, so one failure (an out-of-memory stack, a library's missing keyword) loses that
figure alone and a run cut short keeps what it measured."""

import pytest
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


def test_the_engine_is_timed_over_steps_of_the_whole_batch_and_left_empty(loaded_model):
    """A step's budget of 40 tokens takes one 30-token prompt at a time: the first
    sequence decodes 3 tokens while the other prompts are prefilled, and would end 4 steps
    before the last one with a budget of exactly S + 1 tokens. One untimed step of all 4
    (on a GPU it captures the graph of their context bucket), then every one of the S
    timed steps runs all 4; after, nothing is left in the engine."""
    from gpu_decode import run_engine

    from lamina.engine import Engine, EngineConfig
    from lamina.engine.scheduler import SchedulerLimits

    engine = Engine(loaded_model, EngineConfig(limits=SchedulerLimits(max_batch_size=4, max_step_tokens=40)))
    prompts = [[100 + i] * 30 for i in range(4)]
    assert run_engine(engine, prompts, 5) > 0
    assert engine.num_steps == 4 + 1 + 5  # one prompt a step, the untimed step, then the timed steps
    assert engine.sum_batch_size == (1 + 2 + 3 + 4) + 4 + 5 * 4
    assert not engine.has_work() and engine.kv.used_bytes == 0


def test_the_stack_is_timed_over_steps_of_the_whole_batch(loaded_model, tmp_path):
    """With a hold, the window ends once every sequence made S tokens in it, the streams
    closed there: between S and S + 1 tokens a sequence counted (one micro-batch steps them
    together), where each request could make S + 1 + hold. Traced, the model and the
    attention worker each write what they ran over the window (services/tracing.py, by
    its signals): the model worker its decode slices, the attention worker its kernel."""
    from lamina.planner.measure.stack_run import make_prompts, run_stack

    batch, context, steps, hold = 3, 48, 4, 24
    prompts = make_prompts(loaded_model.tokenizer, batch, context)
    kv_bytes = batch * (context + steps + hold + 128) * loaded_model.config.kv_bytes_per_token() + (64 << 20)
    run = run_stack(prompts, steps, "tcp", 1, False, 1, kv_bytes, "as_file", attention_workers=1, hold=hold,
                    trace_dir=tmp_path, untimed_steps=2)  # as on a GPU: the window from every sequence's third token
    assert batch * steps <= run["tokens"] < batch * (steps + 1)
    assert run["tok_s"] == run["tokens"] / run["seconds"] > 0
    # Each worker's shares as ms a step. The model worker awaits the attention worker's
    # replies every layer, and nothing waits for a GPU on the CPU.
    model_ms, attention_ms = run["ms_per_step"]["model-0"], run["ms_per_step"]["attention-0"]
    assert model_ms["reply_wait"] > 0 and model_ms["device_wait"] == attention_ms["device_wait"] == 0
    step_ms = 1e3 * run["seconds"] * batch / run["tokens"]
    assert model_ms["compute"] == pytest.approx(run["shares"]["model-0"]["compute"] * step_ms)
    assert model_ms["reply_wait"] < step_ms  # one micro-batch: one wait at a time
    (model,) = tmp_path.glob("model-0-pid*-0.txt")
    (attention,) = tmp_path.glob("attention-0-pid*-0.txt")
    assert "operators by self CPU time" in model.read_text() and "aten::" in model.read_text()
    assert "operators by self CPU time" in attention.read_text()
    assert {p.name.removesuffix(".txt") for p in (model, attention)} == \
        {p.name.removesuffix(".json.gz") for p in tmp_path.glob("*.json.gz")}


def test_each_attention_workers_slab_holds_its_share_of_the_sequences():
    """Request partitioning puts each sequence on the least reserved worker: with two,
    each holds half the batch rounded up, and one more; a single sequence fits either."""
    from gpu_decode import attention_slab

    assert attention_slab(100, 64, 1) == 6400
    assert attention_slab(100, 64, 2) == 3300
    assert attention_slab(100, 1, 2) == 200  # the one sequence, on whichever worker
    assert attention_slab(100, 5, 2) == 400


def test_an_unknown_contender_is_refused_before_anything_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_decode.py"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--contenders", "engine,mb3_aw1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    known = "engine,engine_slices,transformers,attention,colocated,colocated_slices,mb2_aw1"
    assert f"--contenders: unknown ['mb3_aw1']; known: {known}" in run.stderr
