"""The mutation check's anchors still match the code (the check itself: ``python -m tests.mutations``).

A refactor that moves an anchor fails here, in the ordinary suite, naming the
mutation to re-anchor.
"""
import os

import pytest

from .mutations import MUTATIONS, ROOT, main


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_anchor_matches_exactly_once(m):
    with open(os.path.join(ROOT, m.path)) as f:
        text = f.read()
    assert text.count(m.old) == 1, f"re-anchor mutation {m.name}: {m.old!r} in {m.path}"
    assert m.old != m.new


def test_unknown_mutation_name_is_bad_input(capsys):
    assert main(["--only", "no-such-mutation"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-mutation" in err
