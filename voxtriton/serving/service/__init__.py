"""The `tts` model's work without Triton types, by role; `tts_service.TTSService` puts them together."""
