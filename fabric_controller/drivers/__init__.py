"""Southbound drivers: the controller's only way to touch switches."""
