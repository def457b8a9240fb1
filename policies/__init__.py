"""Routing decisions: the Policy protocol, built-in policies, speed profiles. Pure code."""
