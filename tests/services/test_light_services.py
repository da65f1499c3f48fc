"""The services that hold no tensors start without torch: the scheduler and the gateway
read a configuration and a tokenizer only, and importing torch (directly, through
transformers' AutoTokenizer, or through a package's eager imports) cost each of them
about 3 s of CPU at every start of a stack."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from lamina.model.tokenizer import _tokenizer_class

PROBE = textwrap.dedent("""
    import sys
    import lamina.services.gateway.gateway_service
    import lamina.services.scheduler.scheduler_service
    from lamina.model.checkpoints import load_tokenizer
    from lamina.services.config import StackConfig

    config = StackConfig(model=sys.argv[1] if len(sys.argv) > 1 else None)
    config.transport_config()
    tokenizer, cfg = load_tokenizer(config.model)
    ids = tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\\n"), ids
    print(sorted(m for m in ("torch", "numpy", "transformers.models.auto") if m in sys.modules))
""")


def _imported(*argv: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().replace("'", '"'))


def test_the_scheduler_and_the_gateway_do_not_import_torch():
    assert "torch" not in _imported()  # the default checkpoint (a converted GGUF file)


def test_nor_for_a_random_model():
    from lamina.model.checkpoints import resolve_checkpoint

    resolve_checkpoint("random:smollm2-135m")  # its weights written here: writing them needs torch
    assert "torch" not in _imported("random:smollm2-135m")


def test_the_generic_tokenizer_class_is_the_one_autotokenizer_picks(loaded_model, tmp_path):
    """Bypassing AutoTokenizer changes nothing: for the checkpoints that name the generic
    backend it loads that very class; any other name still goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    directory = Path(loaded_model.weights_dir)
    assert type(AutoTokenizer.from_pretrained(str(directory))) is _tokenizer_class(directory)
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert _tokenizer_class(named) is AutoTokenizer
