"""Peer-to-peer layer: identity, wire format, DHT access. Never imports `node`."""
