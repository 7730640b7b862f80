"""The composition root: wires the engine and the phone edge together behind the `kame-phone` CLI."""
