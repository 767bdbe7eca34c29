"""kvpress presses built from this harness's own methods (`from baselines.presses.centroidkv_press
import CentroidKVPress`).

Not a method module: the method registry (`centroidkv.methods`) imports `baselines`' own modules and
packages, not the modules inside this package, so kvpress (an optional extra, whose import wraps every
attention function of transformers) is imported only by code that asks for a press.
"""
