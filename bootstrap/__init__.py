"""DHT-only bootstrap peer."""
