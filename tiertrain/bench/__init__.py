"""Benchmarks that ship with the command line (`tiertrain bench ...`)."""
