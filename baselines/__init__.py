"""Baseline compression methods, one module each.

Nothing is listed here: `centroidkv.methods` imports every module of this package (private `_name`
modules excepted) on the first registry look-up, and each module registers its methods with
`@register`. To add a method, drop a file here.
"""
