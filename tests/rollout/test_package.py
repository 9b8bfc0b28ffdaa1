"""The names `weir.rollout` exports for a loop of one's own (examples/minimal_grpo.py)."""

from tests.fresh_python import printed_words


def test_the_exports_are_the_functions_whichever_module_was_imported_first():
    """`evaluate` is both a module of the package and the function it exports. A process that
    had imported the module (the sync loop does) before `from weir.rollout import evaluate` got
    the module, and the example failed with "'module' object is not callable"."""
    program = (
        "import weir.rollout.evaluate, weir.rollout.collect, weir.rollout.single_turn; "
        "from weir.rollout import RolloutContext, collect_groups, evaluate, get_reward, rollout; "
        "import weir.rollout.rewards; "
        "print([callable(f) and not isinstance(f, type(weir)) for f in "
        "(RolloutContext, collect_groups, evaluate, get_reward, rollout)], "
        "evaluate.__module__, weir.rollout.evaluate.__name__)"
    )
    assert printed_words(program) == [
        "[True,",
        "True,",
        "True,",
        "True,",
        "True]",
        "weir.rollout.evaluate",
        "evaluate",
    ]
