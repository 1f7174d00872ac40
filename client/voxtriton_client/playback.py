"""What a listener experiences: simulated playback of chunks as they arrive.

Playback starts when the first chunk arrives (the client plays at once). Each chunk plays for its
duration; when the buffer runs dry before the next chunk arrives, that wait is stall time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlaybackReport:
    ttfa_s: float | None  # request sent -> first audio received
    stall_s: float  # total time the listener waited with an empty buffer after playback began
    stalls: int  # number of separate stalls
    audio_s: float  # audio received
    finished_playing_s: float | None  # request sent -> playback of the last sample ends
    late_chunks: tuple[int, ...] = ()  # positions of the chunks that arrived after the buffer ran dry

    @property
    def stalled(self) -> bool:
        return self.stall_s > 0


def simulate_playback(sent_at: float, arrivals: list[tuple[float, float]]) -> PlaybackReport:
    """arrivals: (arrival time, audio seconds) per chunk, in order; times on the sender's clock."""
    if not arrivals:
        return PlaybackReport(None, 0.0, 0, 0.0, None)
    play_until = arrivals[0][0]  # the moment the buffer runs dry
    stall, late, audio = 0.0, [], 0.0
    for index, (arrived, seconds) in enumerate(arrivals):
        if arrived > play_until:
            stall += arrived - play_until
            late.append(index)
            play_until = arrived
        play_until += seconds
        audio += seconds
    return PlaybackReport(
        arrivals[0][0] - sent_at, stall, len(late), audio, play_until - sent_at, tuple(late)
    )
