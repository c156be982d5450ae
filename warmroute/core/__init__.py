"""The pure routing core: request -> routing key -> chained block hashes -> prefix index -> strategy -> choice.

Nothing in this package does I/O, sleeps or reads a clock, so the simulator can call it a million times and
a test can call it with plain values.
"""
