"""Bytes, local or remote: file access, atomic writes, containment, copies, progress, output options."""
