"""The lane policy on a simulated clock: deadlines, urgency, batching, ordering, no starvation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from voxtriton.scheduler import POLICY_NAMES, get_policy
from voxtriton.scheduler.policy import (
    BACKGROUND,
    GPU_FIRST_CHUNK_HOLD_S,
    GPU_SINGLE_FRAME_START_STREAMS,
    INLINE,
    URGENT,
    ChunkScheduler,
    SchedulerConfig,
)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def scheduler(**overrides):
    clock = Clock()
    config = SchedulerConfig(**{"initial_decode_estimate_s": 0.05, **overrides})
    return ChunkScheduler(config, clock), clock


def serve(sched, lane, seconds=0.01):
    """One decode call on `lane`: take a batch and complete it."""
    batch = sched.next_batch(lane)
    for chunk in batch:
        sched.chunk_done(chunk, seconds)
    return batch


def test_chunk_sizes_follow_the_schedule_and_the_last_repeats():
    config = SchedulerConfig()
    assert [config.chunk_frames(i) for i in range(11)] == [2, 2, 4, 4, 8, 8, 16, 16, 25, 25, 25]
    assert SchedulerConfig(chunk_schedule="3").chunk_frames(5) == 3
    doubling = SchedulerConfig(chunk_schedule="2, 2,4,8,16,25")
    assert [doubling.chunk_frames(i) for i in range(7)] == [2, 2, 4, 8, 16, 25, 25]


def test_catch_up_takes_the_largest_size_the_generated_frames_fill():
    def chunks_cut(catch_up):
        sched, clock = scheduler(policy="concurrent", catch_up=catch_up)  # one lane
        sched.open("s")
        sched.frames_generated("s", 2)  # the first chunk: 2 frames, whatever follows
        sched.frames_generated("s", 10)  # generation runs ahead while it decodes: 10 frames wait
        cut = []
        while batch := serve(sched, URGENT):
            cut += batch
        sched.frames_generated("s", 5, done=True)
        while batch := serve(sched, URGENT):
            cut += batch
        return [(c.first_frame, c.frames, c.decode_frames) for c in cut]

    # 10 frames wait: 8 of them make the second chunk, the first 8 of the schedule; the 7 left at
    # the end make the last chunk, the second 8, padded.
    assert chunks_cut(catch_up=True) == [(0, 2, 2), (2, 8, 8), (10, 7, 8)]
    # The schedule as it is: 2, 2, 4 and 4 take the first 12 frames; the last 5 make an 8, padded.
    assert chunks_cut(catch_up=False) == [(0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 4, 4), (12, 5, 8)]


def test_catch_up_does_not_skip_a_repeated_size_its_frames_only_fill():
    config = SchedulerConfig(catch_up=True)  # 2,2,4,4,8,8,16,16,25
    assert config.catch_up_position(2, 4) == 2  # 4 frames fill the first 4; the second 4 stays next
    assert config.catch_up_position(2, 7) == 2
    assert config.catch_up_position(2, 8) == 4  # the first 8
    assert config.catch_up_position(1, 100) == 8 and config.catch_up_position(9, 100) == 9
    assert config.catch_up_position(5, 3) == 5  # never back
    with pytest.raises(ValueError, match="never shrinks"):  # "the largest size" needs sizes in order
        SchedulerConfig(catch_up=True, chunk_schedule="2,16,4")


def test_a_stream_waiting_for_text_sends_its_frames_once_its_listener_needs_them():
    """Input streaming: frames that wait for text to fill the schedule's next size go out as the
    largest schedule size they fill when the stream is paused for text and its slack is below the
    margin; the schedule's size stays next."""
    sched, clock = scheduler(slack_margin_s=0.3)  # 2,2,4,4,8,...; background estimate 0.05
    sched.open("s")
    sched.frames_generated("s", 2)
    serve(sched, URGENT)  # the first chunk, sent at 0: 0.16 s of audio
    sched.frames_generated("s", 2)
    serve(sched, URGENT)  # 0.32 s of audio sent; 4 frames are next
    sched.frames_generated("s", 3)  # then the stream runs out of text
    assert sched.next_batch(URGENT) == []
    sched.set_text_waits({"s"})
    [chunk] = sched.next_batch(URGENT)  # slack 0.32 - 0.1 < 0.3: the 2 of 3 frames a size fills
    assert (chunk.first_frame, chunk.frames, chunk.decode_frames, chunk.last) == (4, 2, 2, False)
    sched.chunk_done(chunk, 0.01)
    assert sched.next_batch(URGENT) == []  # 1 frame left: no schedule size is that small
    sched.set_text_waits(set())  # text came: the next chunk is the schedule's 4 again
    assert "s" not in sched.text_waiting
    [chunk] = sched.frames_generated("s", 3)
    assert (chunk.first_frame, chunk.frames) == (6, 4)


def test_a_stream_waiting_for_text_keeps_its_frames_while_its_listener_has_audio():
    sched, clock = scheduler(slack_margin_s=0.3)
    sched.open("s")
    sched.frames_generated("s", 2)
    serve(sched, URGENT)
    for size in (2, 4, 4):  # 0.16 + 0.8 s of audio sent at 0: deadline 0.96
        [chunk] = sched.frames_generated("s", size)
        serve(sched, chunk.lane)
    sched.frames_generated("s", 5)  # 8 are next
    sched.set_text_waits({"s"})
    assert sched.next_batch(URGENT) == [] and sched.next_batch(BACKGROUND) == []
    send_at = sched.next_text_wait_send()
    assert send_at == pytest.approx(0.96 - sched.expected_background_s() - 0.3)
    clock.now = send_at - 0.01
    assert not sched.send_for_text_waits()
    clock.now = send_at + 0.01
    assert sched.send_for_text_waits()
    [chunk] = sched.next_batch(URGENT)
    assert (chunk.frames, chunk.decode_frames) == (4, 4)
    assert sched.next_text_wait_send() is None  # a chunk in flight, then 1 frame: nothing to send


def test_text_waits_change_nothing_before_the_first_chunk_or_when_turned_off():
    """Frames that a schedule size fills wait all the same: 3 before an 8-frame first chunk (a 2
    would fit), and 5 before an 8 with the setting off (a 4 would fit)."""
    cases = (("8,2", {}, 0, 3), ("4,8", {"text_wait_send": False}, 4, 5))
    for schedule, config, first_chunk, pending in cases:
        sched, clock = scheduler(slack_margin_s=0.3, chunk_schedule=schedule, **config)
        sched.open("s")
        if first_chunk:
            sched.frames_generated("s", first_chunk)
            serve(sched, URGENT)
        sched.frames_generated("s", pending)
        sched.set_text_waits({"s"})
        clock.now = 10.0  # long past any deadline
        assert not sched.send_for_text_waits() and sched.next_text_wait_send() is None
        assert sched.next_batch(URGENT) == []
    sched.close("s")
    assert sched.text_waiting == set()


def test_a_stream_whose_text_is_arriving_starts_with_the_first_size_of_text_start_frames():
    """The start skips the schedule's smaller sizes only while text is arriving; the schedule goes
    on after the start's size, and a stream whose text ended first starts as any other."""
    config = SchedulerConfig(text_start_frames=5)  # 2,2,4,4,8,8,16,16,25
    assert (config.first_position(False), config.first_position(True)) == (0, 4)
    assert SchedulerConfig(text_start_frames=40).first_position(True) == 8  # the largest size
    shrinking = SchedulerConfig(chunk_schedule="4,16,8", text_start_frames=20)
    assert shrinking.first_position(True) == 1  # the largest, not the last
    assert (config.first_position(True, start_frames=1), config.first_position(True, 3)) == (0, 2)

    def chunks_cut(text_open):
        sched, clock = scheduler(text_start_frames=5, policy="concurrent")
        sched.open("s").text_open = text_open
        cut = []
        for _ in range(24):
            sched.frames_generated("s", 1)
            while batch := serve(sched, URGENT):
                cut += batch
        return [chunk.frames for chunk in cut]

    assert chunks_cut(text_open=True) == [8, 8]  # then 16, which 8 frames do not fill
    assert chunks_cut(text_open=False) == [2, 2, 4, 4, 8]

    # The text ends while 3 frames wait for the start's 8: the next frame cuts the first size.
    sched, clock = scheduler(text_start_frames=5, policy="concurrent")
    stream = sched.open("s")
    stream.text_open = True
    assert sched.frames_generated("s", 3) == []
    stream.text_open = False
    [chunk] = sched.frames_generated("s", 1)
    assert (chunk.index, chunk.frames) == (0, 2)
    with pytest.raises(ValueError, match="text_start_frames"):
        SchedulerConfig(text_start_frames=0)


def test_under_light_load_a_whole_text_starts_with_one_frame_then_the_schedule():
    """`single_frame_start_streams`: while at most that many streams are open, a stream whose text
    is whole starts with a 1-frame chunk, and the schedule follows from its first size; not above
    it, not for an input stream whose text is arriving, not for a stream pinned to a lane, and
    never with 0."""

    def first_sizes(open_streams, light=2, text_open=False, lane=None, policy="concurrent"):
        sched, clock = scheduler(policy=policy, single_frame_start_streams=light)
        for other in range(open_streams - 1):
            sched.open(f"other{other}")
        stream = sched.open("s", lane=lane)
        stream.text_open = text_open
        sizes = []
        for _ in range(9):
            sched.frames_generated("s", 1)
            while batch := sched.next_batch(lane or URGENT):
                sizes += [chunk.decode_frames for chunk in batch if chunk.stream is stream]
                for chunk in batch:
                    sched.chunk_done(chunk, 0.01)
        return sizes

    assert first_sizes(open_streams=2) == [1, 2, 2, 4]
    assert first_sizes(open_streams=3) == [2, 2, 4]
    assert first_sizes(open_streams=1, text_open=True) == [4, 4]  # the text's start
    assert first_sizes(open_streams=1, lane=BACKGROUND, policy="voxserve") == [2, 2, 4]
    assert first_sizes(open_streams=1, light=0) == [2, 2, 4]
    sched, clock = scheduler(policy="concurrent", single_frame_start_streams=2, chunk_schedule="1,2,4")
    sched.open("s")
    cut = []
    for _ in range(7):
        sched.frames_generated("s", 1)
        while batch := serve(sched, URGENT):
            cut += [chunk.frames for chunk in batch]
    assert cut == [1, 2, 4]  # a schedule that starts with 1 frame: no second 1-frame chunk
    with pytest.raises(ValueError, match="single_frame_start_streams"):
        SchedulerConfig(single_frame_start_streams=-2)


def test_the_engine_holds_for_a_first_chunk_only_under_light_load_with_audio_in_hand():
    """`first_chunk_hold_s`: from the cut of a stream's first chunk until its codec call returns, at
    most that long after the cut, the engine holds its next frame step, while the load is light, no
    other stream waits for the frames of its first chunk, and never past the moment a playing stream
    (still generating) would keep only `slack_margin_s` of audio; never with 0, nor where the engine
    thread decodes (serial) or the codec has a GPU of its own (disaggregated)."""
    sched, clock = scheduler(
        policy="concurrent", single_frame_start_streams=3, first_chunk_hold_s=0.3, chunk_schedule="2,8"
    )
    playing = sched.open("playing")
    sched.frames_generated("playing", 2)
    serve(sched, URGENT)  # its first chunk (0.16 s of audio) sent at 0
    sched.frames_generated("playing", 8)
    serve(sched, URGENT)  # 0.8 s of audio sent: its listener runs dry at 0.8
    clock.now = 0.3
    new = sched.open("new")
    assert sched.first_chunk_hold_left() == 0  # its first chunk is not cut yet
    sched.frames_generated("new", 2)
    # Queued: until the playing stream's listener is down to the 0.3 s margin, at 0.5.
    assert sched.first_chunk_hold_left() == pytest.approx(0.2)
    [chunk] = sched.next_batch(URGENT)
    clock.now = 0.45
    assert sched.first_chunk_hold_left() == pytest.approx(0.05)  # in its codec call
    clock.now = 0.51
    assert sched.first_chunk_hold_left() == 0
    playing.generation_done = True  # all its frames are made: holding the backbone costs it nothing
    assert sched.first_chunk_hold_left() == pytest.approx(0.09)  # until 0.3 after the cut
    clock.now = 0.61
    assert sched.first_chunk_hold_left() == 0
    clock.now = 0.55
    sched.open("third")
    assert sched.first_chunk_hold_left() == 0  # the backbone runs for the third stream's first chunk
    sched.frames_generated("third", 2)
    assert sched.first_chunk_hold_left() == pytest.approx(0.3)  # both first chunks cut: the later's
    sched.open("fourth")
    sched.frames_generated("fourth", 2)
    assert sched.first_chunk_hold_left() == 0  # 4 streams open: not light load
    sched.close("fourth")
    sched.close("third")
    assert sched.first_chunk_hold_left() == pytest.approx(0.05)
    chunk.decoded = True  # its call returned: the send does not hold the backbone
    assert sched.first_chunk_hold_left() == 0
    sched.chunk_done(chunk, 0.004)
    assert new.first_sent_at == 0.55

    for policy, hold in (("concurrent", 0.0), ("serial", 0.1), ("disaggregated", 0.1)):
        other, _ = scheduler(policy=policy, single_frame_start_streams=3, first_chunk_hold_s=hold)
        other.open("s")
        other.frames_generated("s", 2)
        assert other.first_chunk_hold_left() == 0, policy
    for bad in (-0.001, -2.0):
        with pytest.raises(ValueError, match="first_chunk_hold_s"):
            SchedulerConfig(first_chunk_hold_s=bad)


def test_a_one_frame_start_and_the_first_chunk_hold_are_a_gpus_defaults_and_never_a_cpus():
    """Unset, the settings take the device's defaults: a 1-frame start and the hold for first chunks
    under light load on a GPU, neither on a CPU (two frame steps and a codec call there take about
    the first chunk's 80 ms); a value set is kept on both. Unsettled, the config never starts with
    one frame and never holds."""
    unset = SchedulerConfig()
    on_gpu, on_cpu = unset.for_device("cuda"), unset.for_device("cpu")
    assert on_gpu.single_frame_start_streams == GPU_SINGLE_FRAME_START_STREAMS > 0
    assert on_gpu.first_chunk_hold_s == GPU_FIRST_CHUNK_HOLD_S > 0
    assert (on_cpu.single_frame_start_streams, on_cpu.first_chunk_hold_s) == (0, 0)
    for value in (0, 4):
        assert (
            SchedulerConfig(single_frame_start_streams=value).for_device("cuda").single_frame_start_streams
            == value
        )
    for hold in (0.0, 0.05):
        set_on_both = SchedulerConfig(first_chunk_hold_s=hold)
        assert (
            set_on_both.for_device("cuda").first_chunk_hold_s
            == set_on_both.for_device("cpu").first_chunk_hold_s
            == hold
        )
    sched, _ = scheduler(policy="concurrent", single_frame_start_streams=2)
    sched.open("s")
    sched.frames_generated("s", 2)
    assert sched.first_chunk_hold_left() == 0  # unsettled: no hold
    sched, _ = scheduler(policy="concurrent")
    stream = sched.open("s")
    sched.frames_generated("s", 1)
    assert not sched.next_batch(URGENT) and stream.frames_generated == 1  # no 1-frame chunk cut


def test_a_first_chunk_is_due_the_ttfa_target_after_the_service_took_its_request():
    """Not after the request arrived: its reference recording's encoding (or an input stream's
    wait for its first words) may outlast the target, and a due time in the past would put the
    chunk ahead of every stream's next chunk."""
    sched, clock = scheduler(ttfa_target_s=0.2)
    clock.now = 1.0
    stream = sched.open("s")
    stream.opened_at, stream.submitted_at = 0.5, 1.0  # arrived 0.5 s ago, its voice encoded now
    [first] = sched.frames_generated("s", 2)
    assert first.due(0.2) == pytest.approx(1.2)
    stream.submitted_at = None  # a stream opened without it: from its arrival
    assert first.due(0.2) == pytest.approx(0.7)


def test_invalid_configuration_is_refused():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="fastest")
    for schedule in ("", "2,0,4", "2,x"):
        with pytest.raises(ValueError, match="chunk_schedule"):
            SchedulerConfig(chunk_schedule=schedule)


def test_deadline_arithmetic_and_stall_tracking():
    sched, clock = scheduler()
    stream = sched.open("s")
    assert stream.deadline() is None
    [first] = sched.frames_generated("s", 2)
    clock.now = 1.0
    [second] = sched.chunk_done(sched.next_batch(URGENT)[0], 0.02) or [None]
    assert second is None  # the next chunk needs 2 more frames; none generated yet
    assert stream.first_sent_at == 1.0 and stream.audio_sent_s == pytest.approx(0.16)
    assert stream.deadline() == pytest.approx(1.16)
    [chunk] = sched.frames_generated("s", 2)
    assert (chunk.first_frame, chunk.frames) == (2, 2)
    clock.now = 1.5  # 0.34 s after the buffer ran dry
    sched.chunk_done(sched.next_batch(chunk.lane)[0], 0.02)
    assert stream.stall_s == pytest.approx(0.34) and sched.deadline_misses == 1
    assert stream.deadline() == pytest.approx(1.0 + 0.16 + 0.16 + 0.34)


def test_first_chunk_is_always_urgent_and_slack_decides_the_rest():
    sched, clock = scheduler(slack_margin_s=0.3, chunk_schedule="1")
    sched.open("s")
    [first] = sched.frames_generated("s", 1)
    assert first.lane == URGENT
    serve(sched, URGENT)  # sent at t=0: deadline = 0.08
    [late] = sched.frames_generated("s", 1)
    assert late.lane == URGENT  # slack = 0.08 - 0 - 2 x 0.05 (a call in progress, then its own) < 0.3
    serve(sched, URGENT)
    sched.frames_generated("s", 1)
    serve(sched, URGENT)
    # Build up buffered audio: 20 frames sent quickly give 1.6 s before the deadline.
    for _ in range(20):
        chunk = sched.frames_generated("s", 1)[0]
        serve(sched, chunk.lane)
    [relaxed] = sched.frames_generated("s", 1)
    assert relaxed.lane == BACKGROUND
    assert sched.slack(relaxed) >= 0.3
    assert sched.config.lanes == (URGENT, BACKGROUND)


def test_background_slack_counts_the_call_in_progress_and_the_batches_queued():
    """Batches of the background lane's own size (`background_max_batch`, not the urgent lane's)."""
    sched, clock = scheduler(slack_margin_s=0.0, chunk_schedule="25", max_batch=4, background_max_batch=2)
    estimate = sched.estimates[BACKGROUND].seconds
    assert sched.expected_background_s() == pytest.approx(2 * estimate)
    for name in ("a", "b", "c", "d"):  # first chunks are urgent: send them so the next ones have a deadline
        sched.open(name)
        sched.frames_generated(name, 25)
    serve(sched, URGENT)
    for name in ("a", "b", "c", "d"):
        assert sched.frames_generated(name, 25)[0].lane == BACKGROUND
    assert sched.expected_background_s() == pytest.approx(4 * estimate)  # two full batches ahead


def test_background_chunk_running_out_of_slack_is_promoted():
    sched, clock = scheduler(slack_margin_s=0.3, chunk_schedule="25")
    sched.open("s")
    sched.frames_generated("s", 25)
    serve(sched, URGENT)  # 2 s of audio sent at t=0
    [chunk] = sched.frames_generated("s", 25)
    assert chunk.lane == BACKGROUND
    clock.now = 1.8  # the background lane never served it; the listener has 0.2 s left
    assert sched.next_batch(URGENT) == [chunk] and chunk.promoted and chunk.lane == URGENT
    assert sched.queues[BACKGROUND] == []


def background_chunks(sched, clock, names, frames=8):
    """A background chunk of `frames` frames per stream, due in the order of `names` and queued in
    the reverse order."""
    for offset, name in enumerate(names):
        sched.open(name)
        sched.frames_generated(name, frames)
        clock.now = offset * 0.1
        serve(sched, URGENT)  # its first chunk: playback starts, so the deadlines follow `names`
    clock.now = 0.0
    chunks = {}
    for name in reversed(names):
        [chunks[name]] = sched.frames_generated(name, frames)
    assert all(c.lane == BACKGROUND for c in chunks.values())
    return [chunks[name] for name in names]


def test_an_idle_urgent_lane_takes_the_most_urgent_of_a_background_backlog_up_to_its_frame_budget():
    options = {"chunk_schedule": "8", "slack_margin_s": 0.0, "max_batch": 2, "background_max_batch": 2}
    sched, clock = scheduler(idle_urgent_takes_frames=16, **options)
    first, second, third = background_chunks(sched, clock, ["a", "b", "c"])  # more than one call's worth
    assert sched.next_batch(URGENT) == [first, second]  # 16 frames, earliest deadlines first
    assert first.lane == URGENT and first.taken and not first.promoted
    assert sched.next_batch(BACKGROUND) == [third] and not third.taken
    # Not without a backlog (an idle background lane takes its own), not with urgent work of its
    # own, not beyond the budget, not by default.
    sched, clock = scheduler(idle_urgent_takes_frames=16, **options)
    background_chunks(sched, clock, ["a", "b"])
    assert sched.next_batch(URGENT) == []
    sched, clock = scheduler(idle_urgent_takes_frames=16, **options)
    background_chunks(sched, clock, ["a", "b", "c"])
    sched.open("new")
    [own] = sched.frames_generated("new", 8)
    assert sched.next_batch(URGENT) == [own]
    for budget in (4, 0):
        sched, clock = scheduler(idle_urgent_takes_frames=budget, **options)
        background_chunks(sched, clock, ["a", "b", "c"])
        assert sched.next_batch(URGENT) == []


def test_the_background_lane_takes_larger_calls_than_the_urgent_lane():
    """voxserve's background chunks all have slack, so its lane batches up to `background_max_batch`
    (more audio per GPU second); urgent calls stay at `max_batch`."""
    sched, clock = scheduler(chunk_schedule="8", slack_margin_s=0.0, max_batch=2, background_max_batch=3)
    names = [f"s{i}" for i in range(7)]
    for name in names:
        sched.open(name)
        sched.frames_generated(name, 8)
    assert [len(serve(sched, URGENT)) for _ in range(4)] == [2, 2, 2, 1]  # first chunks
    for name in names:
        sched.frames_generated(name, 8)
    assert sched.queue_depths()[BACKGROUND] == 7
    assert [len(sched.next_batch(BACKGROUND)) for _ in range(4)] == [3, 3, 1, 0]
    with pytest.raises(ValueError, match="background_max_batch >= 1"):
        SchedulerConfig(background_max_batch=0)


@pytest.mark.parametrize("fullest", [False, True])
def test_the_background_lane_can_take_its_fullest_size_instead_of_its_heads(fullest):
    """Two 8-frame chunks due soonest, three 16-frame chunks due later: without
    `background_fullest_size` the head's size goes first; with it the three, in deadline order."""
    sched, clock = scheduler(
        chunk_schedule="4,8,16", slack_margin_s=0.0, max_batch=4, background_fullest_size=fullest
    )
    later, sooner = ["c", "d", "e"], ["a", "b"]
    for names in (later, sooner):
        for name in names:
            sched.open(name)
            sched.frames_generated(name, 4)
        serve(sched, URGENT)  # first chunks: playback starts
        for name in names:
            sched.frames_generated(name, 8)
        if names is later:
            serve(sched, BACKGROUND)  # their 8-frame chunks, in one call
            for name in names:
                sched.frames_generated(name, 16)
    assert len(sched.queues[BACKGROUND]) == 5
    batch = sched.next_batch(BACKGROUND)
    expected = later if fullest else sooner
    assert [c.stream.stream_id for c in batch] == expected
    assert [c.stream.stream_id for c in sched.next_batch(BACKGROUND)] == (sooner if fullest else later)


def test_batches_respect_size_limit_and_equal_chunk_sizes():
    sched, clock = scheduler(max_batch=3, policy="concurrent")
    sched.open("c")  # a stream at its third chunk (4 frames): never in a batch of 2-frame chunks
    for _ in range(2):
        sched.frames_generated("c", 2)
        serve(sched, URGENT)
    sched.frames_generated("c", 4)
    for i in range(5):
        sched.open(f"a{i}")
        sched.frames_generated(f"a{i}", 2)
    for i in range(2):
        sched.open(f"b{i}")
        sched.frames_generated(f"b{i}", 1, done=True)  # a 1-frame final chunk
    sizes = []
    while batch := sched.next_batch(URGENT):
        assert len(batch) <= 3 and len({c.decode_frames for c in batch}) == 1
        sizes.append([c.frames for c in batch])
    # The 1-frame final chunks decode padded to their scheduled 2 frames, in the same calls.
    assert sizes == [[4], [2, 2, 2], [2, 2, 1], [1]]


def test_background_is_earliest_deadline_first():
    sched, clock = scheduler(max_batch=1, background_max_batch=1, chunk_schedule="4", slack_margin_s=0.0)
    for name, sent_at in (("late", 0.5), ("early", 0.0), ("middle", 0.2)):
        sched.open(name)
        sched.frames_generated(name, 4)
        clock.now = sent_at
        serve(sched, URGENT)
    clock.now = 0.0
    for name in ("late", "early", "middle"):
        sched.frames_generated(name, 4)
    order = [sched.next_batch(BACKGROUND)[0].stream.stream_id for _ in range(3)]
    assert order == ["early", "middle", "late"]


def test_policies_route_as_documented():
    for policy, lane in (("serial", INLINE), ("concurrent", URGENT), ("disaggregated", URGENT)):
        sched, clock = scheduler(policy=policy, chunk_schedule="1")
        assert sched.config.lanes == (lane,)
        sched.open("s")
        for _ in range(30):
            [chunk] = sched.frames_generated("s", 1)
            assert chunk.lane == lane
            serve(sched, lane)


def test_the_policies_are_registered_by_name_with_the_properties_the_server_reads():
    assert POLICY_NAMES == ("voxserve", "concurrent", "serial", "disaggregated")
    table = {
        name: (p.lanes, p.deadline_order, p.inline_decode, p.engine_overlap, p.background_partition)
        for name, p in ((name, get_policy(name)) for name in POLICY_NAMES)
    }
    assert table == {
        "voxserve": ((URGENT, BACKGROUND), True, False, True, True),
        "concurrent": ((URGENT,), False, False, True, False),
        "serial": ((INLINE,), False, True, False, False),
        "disaggregated": ((URGENT,), False, False, True, False),
    }
    assert [name for name in POLICY_NAMES if get_policy(name).codec_on_second_gpu] == ["disaggregated"]
    assert [name for name in POLICY_NAMES if get_policy(name).routes_by_slack] == ["voxserve"]
    with pytest.raises(ValueError, match="policy must be one of voxserve, concurrent, serial, disaggregated"):
        get_policy("fastest")


def test_a_pinned_stream_stays_on_its_lane_whatever_its_slack():
    """The warm-up pins a stream per lane: its first chunk goes to the background lane too, and a
    pinned background chunk out of slack is neither promoted nor taken by an idle urgent lane."""
    sched, clock = scheduler(
        slack_margin_s=0.3, chunk_schedule="2", idle_urgent_takes_frames=16, background_max_batch=1
    )
    for name in ("a", "b"):
        sched.open(name, lane=BACKGROUND)
        assert [c.lane for c in sched.frames_generated(name, 2)] == [BACKGROUND]
    serve(sched, BACKGROUND), serve(sched, BACKGROUND)  # their first chunks: playback starts at t=0
    for name in ("a", "b"):
        assert [c.lane for c in sched.frames_generated(name, 2)] == [BACKGROUND]
    clock.now = 5.0  # both listeners ran dry long ago
    assert sched.next_batch(URGENT) == [] and len(sched.queues[BACKGROUND]) == 2


def flood_until_served(sched, clock, victim, call_s=0.01, arrivals_ahead_s=0.09, size=2):
    """Keep the urgent lane busy with calls of `call_s`; a new stream's first chunk (its request
    arrived `arrivals_ahead_s` earlier) becomes ready before each call. Returns when the call
    holding `victim` has finished."""
    for tick in range(1, 1000):
        name = f"flood{tick}"
        sched.open(name, arrived_at=clock.now - arrivals_ahead_s)
        sched.frames_generated(name, size)
        batch = sched.next_batch(URGENT)
        clock.now += call_s
        for chunk in batch:
            sched.chunk_done(chunk, call_s)
        if victim in batch:
            return
    raise AssertionError("never served")


def test_urgent_flood_cannot_starve_a_promoted_chunk():
    """New streams keep arriving (first chunks are urgent); a promoted chunk still arrives in time."""
    sched, clock = scheduler(slack_margin_s=0.3, chunk_schedule="25", max_batch=1)
    sched.open("victim")
    sched.frames_generated("victim", 25)
    serve(sched, URGENT)
    [victim] = sched.frames_generated("victim", 25)
    assert victim.lane == BACKGROUND  # and the background lane is stuck from here on
    flood_until_served(sched, clock, victim, size=25)
    assert victim.promoted and sched.streams["victim"].stall_s == 0 and sched.deadline_misses == 0


def test_next_chunk_beats_first_chunks_well_before_its_deadline():
    """The ramp's small chunks compete with a steady stream of first chunks on the urgent lane. A
    first chunk is due at its TTFA target, so a stream's next chunk is served once its deadline is
    nearer than that, not at the last moment (which, with a call still to run, is a stall)."""
    sched, clock = scheduler(chunk_schedule="2,2,4", max_batch=1, ttfa_target_s=0.2)
    sched.open("victim")
    sched.frames_generated("victim", 2)
    serve(sched, URGENT)  # playback starts: 160 ms of audio buffered
    sched.frames_generated("victim", 2)
    serve(sched, URGENT)  # 320 ms buffered
    [third] = sched.frames_generated("victim", 4)
    assert third.lane == URGENT
    deadline = sched.streams["victim"].deadline()
    flood_until_served(sched, clock, third)
    assert sched.streams["victim"].stall_s == 0 and sched.deadline_misses == 0
    # Served when its deadline came within the flood's due times (arrival + 0.2 s), not at it.
    assert clock.now <= deadline - 0.2 + 0.09 + 0.01 + 1e-9
    # And the flood's first chunks all went out within their TTFA target.
    assert all(s.first_sent_at - s.opened_at <= 0.2 for s in sched.streams.values() if s.first_sent_at)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["open", "frames", "done", "urgent", "background", "tick"]),
            st.integers(0, 5),
            st.integers(1, 30),
        ),
        min_size=20,
        max_size=300,
    ),
    st.sampled_from(["voxserve", "concurrent", "serial"]),
    st.sampled_from([0, 8]),
    st.booleans(),
    st.booleans(),
)
def test_random_sequences_keep_order_and_never_starve(
    events, policy, idle_urgent_takes_frames, background_fullest_size, catch_up
):
    sched, clock = scheduler(
        policy=policy,
        max_batch=4,
        idle_urgent_takes_frames=idle_urgent_takes_frames,
        background_fullest_size=background_fullest_size,
        catch_up=catch_up,
    )
    lanes = [INLINE] if policy == "serial" else [URGENT, BACKGROUND]
    generated: dict[str, int] = {}
    delivered: dict[str, list[tuple[int, int]]] = {}
    decode_sizes: dict[str, list[int]] = {}

    def run_lane(lane):
        for chunk in sched.next_batch(lane):
            name = chunk.stream.stream_id
            assert chunk.stream.in_flight is chunk and chunk.lane in sched.config.lanes
            delivered[name].append((chunk.first_frame, chunk.frames))
            decode_sizes[name].append(chunk.decode_frames)
            sched.chunk_done(chunk, 0.02)

    for kind, which, amount in events:
        names = sorted(generated)
        if kind == "open":
            name = f"s{len(generated)}"
            sched.open(name)
            generated[name], delivered[name], decode_sizes[name] = 0, [], []
        elif kind in ("frames", "done") and names:
            name = names[which % len(names)]
            if not sched.streams[name].generation_done:
                sched.frames_generated(name, amount, done=kind == "done")
                generated[name] += amount
        elif kind == "tick":
            clock.now += amount * 0.01
        elif kind in ("urgent", "background"):
            run_lane(INLINE if policy == "serial" else kind)
    for name in generated:  # every stream finishes generating
        if not sched.streams[name].generation_done:
            sched.frames_generated(name, 1, done=True)
            generated[name] += 1
    for _ in range(sum(generated.values()) + 10):  # drain: bounded by the number of frames
        clock.now += 0.05
        for lane in lanes:
            run_lane(lane)
    for name, frames in generated.items():
        chunks = delivered[name]
        assert sum(size for _, size in chunks) == frames, f"{name}: not every frame delivered"
        assert [start for start, _ in chunks] == [sum(s for _, s in chunks[:i]) for i in range(len(chunks))]
        config = sched.config
        assert all(size <= decoded for (_, size), decoded in zip(chunks, decode_sizes[name]))
        assert all(
            size == decoded for (_, size), decoded in zip(chunks[:-1], decode_sizes[name])
        )  # only the last is short
        if catch_up:  # schedule sizes, never behind the schedule; the first chunk's is kept
            assert decode_sizes[name][:1] in ([], [config.chunk_frames(0)])
            assert all(
                decoded in config.sizes and decoded >= config.chunk_frames(i)
                for i, decoded in enumerate(decode_sizes[name])
            )
        else:
            assert all(decoded == config.chunk_frames(i) for i, decoded in enumerate(decode_sizes[name]))
        assert sched.streams[name].in_flight is None
    assert all(not queue for queue in sched.queues.values())
