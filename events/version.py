"""The version of memstep: written in every log header and executor hello, checked on replay."""

VERSION = "0.1.0"
