"""KAME engine: the four-stream Moshi front-end, batched over call slots, and its real-time frame loop."""
