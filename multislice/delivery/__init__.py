"""Delivery: compile targets, submission and schedules, the UI pages, notification, results read back."""
