from sgl_longgen.core.prepared import Prepared


def test_an_entry_is_taken_once_and_only_for_a_history_it_is_a_prefix_of():
    prepared = Prepared(limit=2)
    prepared.put("a", "index of a", 10)
    assert prepared.take("a", 9) == (None, 0)  # covers more than that history: not its prefix
    prepared.put("a", "index of a", 10)
    assert prepared.take("a", 11) == ("index of a", 10)
    assert prepared.take("a", 11) == (None, 0)  # taken


def test_requests_that_never_start_do_not_pile_up():
    prepared = Prepared(limit=2)
    for rid in "abc":
        prepared.put(rid, rid, 1)
    assert len(prepared) == 2 and prepared.take("a", 1) == (None, 0)  # the oldest went
    prepared.put("b", "b again", 2)  # a new chunk makes it the newest
    prepared.put("d", "d", 1)
    assert prepared.take("c", 1) == (None, 0) and prepared.take("b", 2) == ("b again", 2)
