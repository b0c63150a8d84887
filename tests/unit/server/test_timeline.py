"""The timeline's grouping of requests into saves (ckptd.server.timeline)."""

from ckptd.protocol import Phase
from ckptd.server.requests import SaveRequest
from ckptd.server.timeline import Timeline


def request(request_id: int, rank: int, created: float, ended: float,
            path: str = "/ckpt/iter_2/part_0.pt") -> SaveRequest:
    req = SaveRequest(id=request_id, rank=rank, routing_id=b"c", format="torch", path=path,
                      buffers=[["uint8", [4], 4]], offsets=[0], extent_length=4,
                      created_at=created)
    req.staged_at, req.finished_at, req.phase = created + 0.1, ended, Phase.DONE
    return req


def ranks_of(timeline: Timeline, last: int) -> list:
    saves = [e for e in timeline.trace_events(last) if e.get("cat") == "save"]
    return [sorted(s["args"]["outcomes"]) for s in saves]


def test_a_rank_that_starts_after_another_ended_joins_the_same_save():
    """Ranks of one save do not start together: a fast rank's request may end before a
    slow rank's begins; both belong to one record (the trace showed only the slow one)."""
    timeline = Timeline(daemon_pid=1)
    timeline.record(request(1, 1, created=10.0, ended=10.5), trainer_pid=101)
    timeline.record(request(2, 0, created=11.0, ended=11.5), trainer_pid=100)
    assert ranks_of(timeline, 5) == [[0, 1]]


def test_the_same_rank_saving_the_same_path_again_is_a_new_save():
    timeline = Timeline(daemon_pid=1)
    timeline.record(request(1, 0, created=10.0, ended=10.5), trainer_pid=100)
    timeline.record(request(2, 0, created=20.0, ended=20.5), trainer_pid=100)
    assert ranks_of(timeline, 5) == [[0]]  # the later save replaced the earlier one
    events = timeline.trace_events(1)
    assert {e["args"]["request"] for e in events if e.get("cat") == "staging"} == {2}
