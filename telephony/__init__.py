"""The phone edge: Twilio webhooks and Media Streams, audio codec, call state, metrics. Knows no models."""
