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

import pytest

from lamina.model.errors import CheckpointError
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


def test_the_scheduler_reads_its_eos_ids_without_transformers(loaded_model, tmp_path):
    """The scheduler needs only the EOS ids: read with the tokenizers library they equal
    the whole tokenizer's, for the default checkpoint, a random model and an EOS token
    saved as an AddedToken; the scheduler's start imports no transformers. Without an EOS
    token there, with one outside the vocabulary, or with a configuration that is no JSON
    object, the ids are the whole tokenizer's (or its error)."""
    import shutil

    from lamina.model.checkpoints import load_eos_token_ids, resolve_checkpoint
    from lamina.model.tokenizer import Tokenizer, eos_token_ids

    for spec in (None, "random:smollm2-135m"):
        directory = resolve_checkpoint(spec)[1]
        ids, cfg = load_eos_token_ids(spec)
        assert ids == Tokenizer.from_dir(directory, cfg).eos_token_ids and ids
    cfg = loaded_model.config
    source = Path(loaded_model.weights_dir)
    whole = Tokenizer.from_dir(source, cfg).eos_token_ids

    def variant(name: str, **changes) -> Path:
        directory = tmp_path / name
        shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors", "packed"))
        named = json.loads((directory / "tokenizer_config.json").read_text())
        named.update(changes)
        (directory / "tokenizer_config.json").write_text(json.dumps(named))
        return directory

    added = variant("added", eos_token={"content": "<|im_end|>", "special": True, "__type": "AddedToken"})
    assert eos_token_ids(added, cfg) == whole
    # An EOS outside the vocabulary: transformers' answer (its unknown token), not a guess.
    unknown = variant("unknown", eos_token="<|not-a-token|>")
    assert eos_token_ids(unknown, cfg) == Tokenizer.from_dir(unknown, cfg).eos_token_ids
    missing = variant("missing", eos_token=None)
    assert eos_token_ids(missing, cfg) == Tokenizer.from_dir(missing, cfg).eos_token_ids
    not_an_object = variant("not-an-object")
    (not_an_object / "tokenizer_config.json").write_text("[]")
    with pytest.raises(CheckpointError, match="tokenizer could not be loaded"):
        eos_token_ids(not_an_object, cfg)

    probe = ("import sys; from lamina.services.config import StackConfig; "
             "from lamina.services.scheduler.scheduler_service import SchedulerService; "
             "from lamina.model.checkpoints import load_eos_token_ids; "
             "ids, _ = load_eos_token_ids(StackConfig().model); "
             "print(list(ids), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ids_text, imported = out.stdout.strip().rsplit(" ", 1)
    assert json.loads(ids_text) == list(whole) and imported == "False", out.stdout
