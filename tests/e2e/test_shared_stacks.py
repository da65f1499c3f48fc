"""The order shared stacks impose on tests (shared_stacks.grouped), without a stack."""

from __future__ import annotations

from shared_stacks import grouped


def test_tests_of_one_stack_run_together_where_the_first_of_them_was():
    # (name, stack or None, needs it as started)
    items = [("a1", "A", False), ("x", None, False), ("b1", "B", False), ("a2", "A", False), ("y", None, False),
             ("b2", "B", True), ("a3", "A", False)]
    order = grouped(items, key=lambda i: i[1], first=lambda i: i[2])
    assert [name for name, _, _ in order] == ["a1", "a2", "a3", "x", "b2", "b1", "y"]
