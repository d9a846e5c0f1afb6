"""Sandbox backends: bwrap (default), gvisor, firecracker."""
