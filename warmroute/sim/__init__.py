"""Discrete-event simulation of a routed fleet in virtual time (`warmroute simulate`)."""
