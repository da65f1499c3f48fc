"""The OpenAI API tests of test_stack_api.py, every one, on the colocated layout's shared
stack (shared_stacks.COLOCATED: two model workers, each attending its own sequences in
its own process), so that both layouts answer the same API the same way.

The tests are test_stack_api.py's own functions, collected here a second time under this
module's `stack` mark."""

from __future__ import annotations

import inspect

import pytest
import test_stack_api
from shared_stacks import COLOCATED
from test_stack_api import (  # noqa: F401 (collected by pytest under this module's mark)
    test_a_prompt_of_several_prefill_chunks_equals_transformers,
    test_bad_input_is_answered_clearly_while_others_continue,
    test_chat_and_completions_equal_transformers,
    test_client_disconnect_frees_kv,
    test_continuous_usage_stats_in_every_chunk,
    test_echo_scores_the_prompt_as_transformers,
    test_health_and_metrics,
    test_lm_eval_log_likelihoods_through_the_api_equal_its_hf_model,
    test_logprobs_equal_transformers,
    test_n_choices_share_the_prompt_kv_and_a_disconnect_frees_them_all,
    test_n_greedy_choices_each_equal_transformers_from_one_prefill,
    test_n_seeded_choices_differ_and_repeat,
    test_penalties_and_biases_equal_the_local_engine,
    test_prefix_cache_hit_gives_the_same_tokens,
    test_responses_api_text_equals_the_chat_endpoints,
    test_sixteen_concurrent_requests_of_different_lengths,
    test_structured_output_with_the_clients_typed_parsing,
    test_the_vllm_extensions_load_generators_send,
    test_tool_calls_with_the_clients_typed_parsing,
    test_usage_names_the_prompt_tokens_the_prefix_cache_served,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.stack(COLOCATED)]


def test_every_api_test_runs_here():
    """A test added to test_stack_api.py must be imported above, or the colocated layout
    would not run it."""
    def tests(namespace: dict) -> set[str]:
        return {name for name, obj in namespace.items() if name.startswith("test_") and inspect.isfunction(obj)}

    assert tests(vars(test_stack_api)) == tests(globals()) - {"test_every_api_test_runs_here"}
