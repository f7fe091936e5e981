"""Drafting: the draft head (EAGLE-style), prompt lookup, and the proposer that serves both to SpecEE's
candidates and to speculative decoding's trees."""
