"""The control plane: framed msgpack messages over a Unix socket (page bytes never cross it)."""
