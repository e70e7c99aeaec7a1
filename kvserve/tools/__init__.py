"""Offline tools: capacity planning, provider prompt-cache cost, trace simulation. No torch here."""
