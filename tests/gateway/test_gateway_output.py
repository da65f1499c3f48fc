"""Detokenization and stop strings, the journal and the config: no server involved."""

from __future__ import annotations

import pytest

from lamina.gateway.config import GatewayConfig
from lamina.gateway.journal import RequestJournal
from lamina.gateway.output import OutputProcessor, StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    return [matcher.feed(p) for p in pieces]


def test_without_stop_strings_text_passes_through():
    m = StopStringMatcher([])
    assert feed_all(m, ["a", "b"]) == ["a", "b"] and m.flush() == "" and m.released == "ab"


def test_stop_string_inside_one_delta_cuts_before_it():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abcSTOPdef") == "abc"
    assert m.stopped and m.released == "abc"
    assert m.feed("more") == ""


def test_stop_string_split_over_deltas_is_held_back_then_cut():
    m = StopStringMatcher(["</end>"])
    assert feed_all(m, ["hello <", "/en", "d> tail"]) == ["hello ", "", ""]
    assert m.stopped and m.released == "hello "


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopStringMatcher(["</end>"])
    assert feed_all(m, ["a <", "/e", "x"]) == ["a ", "", "</ex"]
    assert not m.stopped


def test_held_back_text_is_flushed_at_the_end():
    m = StopStringMatcher(["xyz"])
    assert m.feed("abcxy") == "abc"
    assert m.flush() == "xy" and m.released == "abcxy"


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel"


def test_include_stop_keeps_the_stop_string_found_first():
    m = StopStringMatcher(["world", "lo w"], include_stop=True)
    assert m.feed("hello world!") == "hello w" and m.stopped
    m = StopStringMatcher(["</end>"], include_stop=True)
    assert feed_all(m, ["a <", "/en", "d> tail"]) == ["a ", "", "</end>"] and m.released == "a </end>"


def test_output_processor_streams_text_and_hides_eos(tokenizer):
    ids = tokenizer.encode("Paris, café au lait.")
    eos = tokenizer.eos_token_ids[0]
    out = OutputProcessor(tokenizer, [], {eos})
    deltas = [out.add([t], None) for t in ids] + [out.add([eos], "stop")]
    assert "".join(deltas) == "Paris, café au lait." == out.text
    assert out.num_tokens == len(ids) + 1


def test_output_processor_does_not_show_a_stop_token_that_is_an_ordinary_token(tokenizer):
    ids = tokenizer.encode("one two three")
    out = OutputProcessor(tokenizer, [], {ids[-1]})
    assert out.add(ids, "stop") == "one two"


def test_output_processor_applies_stop_strings_across_tokens(tokenizer):
    ids = tokenizer.encode("The answer is 42. Done.")
    out = OutputProcessor(tokenizer, ["42"], set())
    text = "".join(out.add([t], None) for t in ids)
    assert out.stopped and text == out.text == "The answer is "


def test_include_stop_str_in_output_shows_the_stop_string_and_an_ordinary_stop_token(tokenizer):
    ids = tokenizer.encode("The answer is 42. Done.")
    out = OutputProcessor(tokenizer, ["42"], set(), include_stop_str=True)
    assert "".join(out.add([t], None) for t in ids) == "The answer is 42" and out.stopped
    ids = tokenizer.encode("one two three")
    out = OutputProcessor(tokenizer, [], {ids[-1]}, include_stop_str=True)
    assert out.add(ids, "stop") == "one two three"
    eos = tokenizer.eos_token_ids[0]
    out = OutputProcessor(tokenizer, [], {eos}, include_stop_str=True)
    assert out.add(ids + [eos], "stop") == "one two three"  # EOS is special: skipped


def test_skip_special_tokens_false_shows_special_tokens_but_not_the_final_eos(tokenizer):
    ids = tokenizer.encode("one two")
    eos, start = tokenizer.eos_token_ids[0], tokenizer.hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    out = OutputProcessor(tokenizer, [], {eos}, skip_special_tokens=False)
    # An EOS in the middle (ignore_eos) and another special token are shown; the EOS that
    # stopped the output is not (vLLM's rule), unless include_stop_str_in_output.
    assert out.add(ids + [eos, start] + ids + [eos], "stop") == "one two<|im_end|><|im_start|>one two"
    out = OutputProcessor(tokenizer, [], {eos}, include_stop_str=True, skip_special_tokens=False)
    assert out.add(ids + [eos], "stop") == "one two<|im_end|>"
    out = OutputProcessor(tokenizer, [], {eos})
    assert out.add(ids + [eos, start] + ids + [eos], "stop") == "one twoone two"


def test_stop_strings_count_only_after_min_tokens(tokenizer):
    ids = tokenizer.encode("a b a b c")
    out = OutputProcessor(tokenizer, ["a"], set(), min_tokens=2)
    text = "".join(out.add([t], None) for t in ids)
    assert out.stopped and text == "a b "  # the first 'a' (token 1 of 2) does not count


def test_journal_keeps_prompt_and_generated_ids_until_the_end():
    j = RequestJournal()
    j.begin("r1", [1, 2])
    j.extend("r1", [3])
    j.extend("r1", [4, 5])
    entry = j.get("r1")
    assert entry is not None
    assert (entry.prompt_token_ids, entry.generated_token_ids, entry.all_token_ids, entry.num_tokens) == (
        (1, 2), (3, 4, 5), (1, 2, 3, 4, 5), 5)
    assert "r1" in j and j.request_ids() == ["r1"] and len(j) == 1
    with pytest.raises(KeyError):
        j.begin("r1", [9])
    j.end("r1")
    j.end("r1")
    assert j.get("r1") is None and len(j) == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"port": 70000}, "port"),
    ({"api_key": ""}, "api_key"),
    ({"max_queue": -1}, "max_queue"),
    ({"default_max_tokens": 0}, "default_max_tokens"),
    ({"served_model_name": ""}, "served_model_name"),
])
def test_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**kwargs)


def test_served_model_name_overrides_the_checkpoint_name():
    assert GatewayConfig().model_name("ckpt") == "ckpt"
    assert GatewayConfig(served_model_name="alias").model_name("ckpt") == "alias"
