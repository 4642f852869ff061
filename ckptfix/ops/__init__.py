"""Operations on checkpoints: inspect, scan, load, convert, rewrite, sanitize, and the prefix logic they share."""
