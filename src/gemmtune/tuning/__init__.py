"""Tuning: verify, measure and choose among a problem's candidates, in this process or an isolated one."""
