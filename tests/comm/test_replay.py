"""Replaying repeated calls (``comm/replay.py``) on the CPU, with a capture that records instead of a CUDA graph:
a signature is captured on its second call and replayed from then on, a new signature never replays another's
graph, the least recently used graph goes first, and replay is off where it must be."""


from flashoverlap.comm import replay


class FakeGraph:
    def __init__(self, log, issue):
        self.log = log
        issue()  # what a capture does: the call's work is queued (here: logged) once, into the graph

    def replay(self):
        self.log.append("replay")


def _graphs(log, **kw):
    return replay.CallGraphs(None, capture=lambda issue: FakeGraph(log, issue), **kw)


def test_a_signature_is_captured_on_its_second_call_and_replayed_after():
    log = []
    graphs = _graphs(log)
    issue = lambda: log.append("issue")  # noqa: E731
    assert graphs.run("s", issue) is False and log == []  # first call: the caller issues it eagerly
    assert graphs.run("s", issue) is True and log == ["issue", "replay"]
    assert graphs.run("s", issue) is True and log == ["issue", "replay", "replay"]
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 2, 1)


def test_another_signature_never_replays_a_graph_captured_for_the_first():
    log = []
    graphs = _graphs(log)
    for _ in range(3):
        graphs.run("s", lambda: log.append("s"))
    assert graphs.run("t", lambda: log.append("t")) is False
    assert graphs.run("t", lambda: log.append("t")) is True
    assert log == ["s", "replay", "replay", "t", "replay"]


def test_the_least_recently_used_graph_is_dropped_first():
    graphs = _graphs([], capacity=2)
    for signature in ("a", "b", "a", "b", "a", "c", "c"):  # a and b captured, a replayed, then c captured
        graphs.run(signature, lambda: None)
    assert list(graphs._graphs) == ["a", "c"]  # b was the least recently used
    assert graphs.captures == 3


def test_clear_forgets_every_graph_and_every_count():
    graphs = _graphs([])
    for _ in range(2):
        graphs.run("s", lambda: None)
    graphs.clear()
    assert len(graphs) == 0 and graphs.run("s", lambda: None) is False


def test_at_capacity_one_each_capture_replaces_the_graph_before_it():
    log = []
    graphs = _graphs(log, capacity=1)
    for signature in ("a", "a", "b", "b", "a", "a", "a"):  # a captured, b captured (a dropped): a never again
        graphs.run(signature, lambda: None)
    assert list(graphs._graphs) == ["b"] and graphs.captures == 2 and log == ["replay", "replay"]


def test_more_signatures_than_the_capacity_are_captured_once_each_not_on_every_other_call():
    # A model whose calls cycle through more signatures than the graphs kept (a layer's call per layer): each is
    # captured at most once; those dropped for room are issued eagerly from then on (a capture costs milliseconds).
    log = []
    graphs = _graphs(log, capacity=2)
    issued = []
    for _ in range(10):
        for signature in ("a", "b", "c"):
            if not graphs.run(signature, lambda s=signature: issued.append(s)):
                issued.append(signature)
    assert graphs.captures == 3 and len(graphs) == 2
    assert graphs.replays + len(issued) - graphs.captures == 30  # every call either replayed or issued eagerly
    graphs.clear()
    assert graphs.run("a", lambda: None) is False and graphs.run("a", lambda: None) is True  # clear forgets drops
