"""HybridRadixCache's request glue driven the way the scheduler drives it (see tests/test_radix_cache.py's
Harness): chunked prefill, decode, retraction and finishing, with a fake model whose state row grows by
the tokens each forward consumes. Every admission's match must end at the longest cached prefix that
has a snapshot and restore exactly that prefix's state; KV slots and snapshot slots never leak."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hybrid_cache_helpers import check_pools, contents, make_cache, snapshot_len
from tests.radix_cache_helpers import POLICIES, FakeReq, RequestHarness, cached_len, request


class Harness(RequestHarness):
    """RequestHarness over a HybridRadixCache, with a model in miniature: a request's state row grows
    by the tokens each forward consumes."""

    def __init__(
        self, size: int, snapshots: int, policy: str = "lru", disable: bool = False, track: bool = False
    ) -> None:
        cache, self.states = make_cache(size, snapshots, policy, disable)
        super().__init__(cache)
        self.cache = cache  # the hybrid type, for its snapshot methods
        self.track = track  # forwards that end a prefill save the state one token short (track_state)

    def admit(self, input_ids: list[int], output: list[int], chunk: int = 64, priority: int = 0) -> FakeReq:
        key = input_ids[:-1]  # the last prompt token is always computed
        kv, snaps = contents(self.cache, self.states)
        match = self.cache.match_prefix(key)
        n = len(match.indices)
        assert n == snapshot_len(kv, snaps, key) and match.kv_len == cached_len(kv, key)
        self.cache.inc_lock_ref(match.last_node)
        rows = self.pool.alloc(1)
        assert rows is not None
        self.pool.write(rows[0], 0, match.indices)
        req = FakeReq(rows[0], input_ids, match.indices, match.last_node, n, output, chunk, priority)
        self.states.set_row(rows[0], [])  # the zero state
        assert self.cache.restore_prefix_state(req) == (n > 0)
        assert self.states.rows[rows[0]].tolist() == input_ids[:n]  # the state at the hit point
        return req

    def compute_kv(self, req: FakeReq, end: int) -> None:
        """RequestHarness.compute_kv, and the state row consumes the same tokens; with tracking, a
        forward of two tokens or more that ends the prefill writes its state a token short to a slot."""
        start = req.kv_committed_len
        if self.track and end - start >= 2 and end == len(req.all_ids):
            slot = self.cache.track_state(req, end - 1)
            if slot is not None:
                self.states.slots[slot] = torch.tensor(req.all_ids[: end - 1], dtype=torch.int64)
        super().compute_kv(req, end)
        assert req.req_pool_idx is not None
        row, consumed = req.req_pool_idx, torch.tensor(req.all_ids[start:end], dtype=torch.int64)
        self.states.rows[row] = torch.cat((self.states.rows[row], consumed))

    def check(self, running: list[FakeReq]) -> None:
        owned: list[int] = []
        for req in running:
            assert req.req_pool_idx is not None
            assert self.states.rows[req.req_pool_idx].tolist() == req.all_ids[: req.kv_committed_len]
            slots = self.pool.read(req.req_pool_idx, 0, req.kv_committed_len).tolist()
            assert [self.kv[s] for s in slots] == [tuple(req.all_ids[: p + 1]) for p in range(len(slots))]
            owned += slots if self.cache.disable else slots[len(req.prefix_indices) :]
        kv, snaps = contents(self.cache, self.states)
        assert all(self.kv[slot] == prefix for prefix, slot in kv.items())
        check_pools(self.cache, kv, snaps, owned)

    def check_idle(self) -> None:
        """Nothing leaks: with every request done, evicting everything gives back every slot."""
        self.check([])
        cache = self.cache
        assert cache.protected_size() == cache.protected_snapshot_count() == 0
        assert self.pool.available_size() == self.pool.size
        cache.evict(cache.evictable_size())
        cache.evict_snapshots(cache.snapshot_count())
        assert cache.total_size() == cache.snapshot_count() == 0
        assert self.allocator.available_size() == self.allocator.size
        assert cache.state_slots.available_size() == cache.state_slots.total
        cache.reset()
        assert cache.match_prefix([0, 1, 2]).kv_len == 0


def _serve(harness: Harness, specs: list[tuple], data: st.DataObject) -> None:
    """Run every request to completion in a drawn interleaving (with evictions and retractions),
    checking pools, states and matches after each step."""
    waiting, running = list(specs), []
    while waiting or running:
        what = data.draw(st.sampled_from(["step", "step", "evict", "evict_snapshots", "retract"]), label="op")
        if what == "evict":
            harness.cache.evict(data.draw(st.integers(0, 6), label="tokens"))
        elif what == "evict_snapshots":
            harness.cache.evict_snapshots(data.draw(st.integers(0, 2), label="snapshots"))
        if harness.fits(running, waiting) and (not running or data.draw(st.booleans(), label="admit")):
            running.append(harness.admit(*waiting.pop(0)))
        elif what == "retract" and running:
            req = running.pop(data.draw(st.integers(0, len(running) - 1), label="victim"))
            harness.cache.cache_finished_req(req)  # as retract() does; it frees the request's row
            waiting.append((req.all_ids, req.target_output[len(req.output_ids) :], req.chunk, req.priority))
        elif running:
            harness.step_drawn(running, data)
        harness.check(running)
    harness.check_idle()


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    num_slots=st.integers(0, 4),
    track=st.booleans(),
    specs=st.lists(request, min_size=1, max_size=5),
    data=st.data(),
)
def test_requests_restore_the_snapshotted_state_without_leaking(
    policy: str, num_slots: int, track: bool, specs: list[tuple], data: st.DataObject
) -> None:
    totals = [len(i) + len(o) for i, o, _, _ in specs]
    size = data.draw(st.integers(max(totals), sum(totals)), label="pool size")
    _serve(Harness(size, num_slots, policy, track=track), specs, data)


@settings(max_examples=15, deadline=None)
@given(specs=st.lists(request, min_size=1, max_size=4), data=st.data())
def test_disabled_cache_keeps_no_kv_and_no_snapshot(specs: list[tuple], data: st.DataObject) -> None:
    harness = Harness(sum(len(i) + len(o) for i, o, _, _ in specs), 4, disable=True, track=True)
    _serve(harness, specs, data)


def test_no_snapshot_slots_caches_kv_that_is_never_matched_and_goes_first() -> None:
    harness = Harness(size=16, snapshots=0)
    req = harness.admit([1, 2, 3, 4], [5])
    assert harness.step(req)
    assert harness.cache.total_size() == 4 and harness.cache.snapshot_count() == 0
    again = harness.admit([1, 2, 3, 4], [5])
    assert again.kv_committed_len == 0 and again.last_node is harness.cache.root
    assert harness.step(again)
    harness.check_idle()


def test_finished_req_is_snapshotted_where_its_state_and_kv_agree() -> None:
    harness = Harness(size=16, snapshots=4)
    req = harness.admit([1, 2, 3], [4, 5])
    assert not harness.step(req) and harness.step(req)
    # KV and state cover [1, 2, 3, 4]; the last sampled token 5 is in neither.
    kv, snaps = contents(harness.cache, harness.states)
    assert snaps == {(1, 2, 3, 4)} and len(kv) == 4
    dropped = harness.admit([7, 8, 9], [])
    harness.compute_kv(dropped, 4)  # a committed position whose token was dropped: state has 4 tokens
    harness.cache.cache_finished_req(dropped)
    assert contents(harness.cache, harness.states)[1] == {(1, 2, 3, 4)}
    harness.check_idle()


def test_chunk_boundaries_leave_snapshots_a_later_request_resumes_from() -> None:
    harness = Harness(size=32, snapshots=8)
    first = harness.admit([1, 2, 3, 4, 5, 6, 7], [9], chunk=3)
    while not harness.step(first):
        pass
    assert contents(harness.cache, harness.states)[1] == {
        (1, 2, 3),
        (1, 2, 3, 4, 5, 6),
        (1, 2, 3, 4, 5, 6, 7),
    }
    second = harness.admit([1, 2, 3, 4, 5, 0, 0], [9])  # resumes at 3 tokens: KV to 5, no state there
    assert len(second.prefix_indices) == 3
    assert harness.step(second)
    harness.check_idle()


def test_a_chunk_ending_at_kv_len_leaves_a_snapshot_at_the_branch_point() -> None:
    harness = Harness(size=32, snapshots=8)
    first = harness.admit([1, 2, 3, 4, 5, 6], [9])
    assert harness.step(first)  # snapshotted at its end only: [1, 2, 3, 4, 5, 6]
    match = harness.cache.match_prefix([1, 2, 3, 4, 7, 7])
    assert len(match.indices) == 0 and match.kv_len == 4
    second = harness.admit([1, 2, 3, 4, 7, 7, 7], [9], chunk=match.kv_len)  # the scheduler's cap
    while not harness.step(second):
        pass
    third = harness.admit([1, 2, 3, 4, 8, 8], [9])
    assert len(third.prefix_indices) == 4  # resumes at the branch point with its state
    assert harness.step(third)
    harness.check_idle()


def test_a_tracked_prefill_leaves_its_snapshot_one_token_short_for_the_same_prompt() -> None:
    harness = Harness(size=32, snapshots=4, track=True)
    first = harness.admit([1, 2, 3, 4, 5], [6, 7])
    assert not harness.step(first, cache_after=True)  # the prefill: tracked at 4 tokens, cached at 5
    assert harness.cache.tracking_count() == 0
    assert contents(harness.cache, harness.states)[1] == {(1, 2, 3, 4)}  # not (1, 2, 3, 4, 5)
    second = harness.admit([1, 2, 3, 4, 5], [6, 7])
    assert len(second.prefix_indices) == 4  # all but the last prompt token
    assert harness.step(first)
    assert contents(harness.cache, harness.states)[1] == {(1, 2, 3, 4), (1, 2, 3, 4, 5, 6)}
    assert not harness.step(second) and harness.step(second)  # one token: nothing to track
    harness.check_idle()


def test_a_tracked_slot_held_until_the_request_finishes_goes_in_beside_the_end_snapshot() -> None:
    harness = Harness(size=32, snapshots=4, track=True)
    req = harness.admit([1, 2, 3], [4, 5])
    assert not harness.step(req)  # tracked at 2; not cached yet: the request holds the slot
    assert harness.cache.tracking_count() == 1
    harness.check([req])
    assert harness.step(req)
    assert contents(harness.cache, harness.states)[1] == {(1, 2), (1, 2, 3, 4)}
    harness.check_idle()


def test_track_state_takes_only_a_point_inside_the_step_and_one_slot_at_a_time() -> None:
    harness = Harness(size=16, snapshots=2)
    req = harness.admit([1, 2, 3, 4], [5])
    req.fill_ids = req.all_ids
    for end in (0, 4):
        with pytest.raises(ValueError, match="is not inside the step's tokens 0..3"):
            harness.cache.track_state(req, end)
    slot = harness.cache.track_state(req, 3)
    assert slot is not None
    harness.states.slots[slot] = torch.tensor([1, 2, 3])  # what the forward writes
    with pytest.raises(ValueError, match="already tracks slot"):
        harness.cache.track_state(req, 3)
    harness.compute_kv(req, 4)
    harness.cache.cache_finished_req(req)
    assert harness.cache.tracking_count() == 0
    assert contents(harness.cache, harness.states)[1] == {(1, 2, 3)}
    harness.check_idle()
