"""Rollout: how prompts become scored groups (rollout functions, rewards, filters)."""
