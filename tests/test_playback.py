"""Simulated playback: the stall definition of ../shared/design.md, on hand-made arrival times."""

from voxtriton_client import simulate_playback


def test_stalls_count_the_wait_after_the_buffer_runs_dry_and_name_the_late_chunks():
    # Sent at 1.0; chunks of 0.16, 0.16, 0.32 and 0.32 s arrive at 1.1, 1.2, 1.5 and 1.7.
    report = simulate_playback(1.0, [(1.1, 0.16), (1.2, 0.16), (1.5, 0.32), (1.7, 0.32)])
    # Playback: 1.1-1.26, 1.26-1.42, dry until 1.5 (0.08 s stall), 1.5-1.82, 1.82-2.14.
    assert abs(report.ttfa_s - 0.1) < 1e-9
    assert abs(report.stall_s - 0.08) < 1e-9 and report.stalls == 1 and report.late_chunks == (2,)
    assert abs(report.audio_s - 0.96) < 1e-9 and abs(report.finished_playing_s - 1.14) < 1e-9


def test_a_chunk_arriving_exactly_as_the_buffer_runs_dry_is_not_a_stall():
    report = simulate_playback(0.0, [(0.1, 0.5), (0.6, 0.5)])
    assert report.stall_s == 0 and report.late_chunks == () and not report.stalled


def test_no_chunks_means_no_audio():
    report = simulate_playback(0.0, [])
    assert report.ttfa_s is None and report.audio_s == 0 and report.late_chunks == ()
