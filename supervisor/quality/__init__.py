"""Serving quality verdicts: the canary's comparison, decode speed, speculation's accept length,
the decode path (CUDA graphs). Pure and total: arbitrary input in, a verdict out, no I/O.

Two modules by concern: `answers` (one answer: parsing, the comparison with the golden, the known
answers) and `watches` (a launch over time: speed, accept length, CUDA graphs); every name is
importable from here. docs/quality.md says why each rule is what it is and what was measured on
the real server.
"""

from __future__ import annotations

from supervisor.quality.answers import CANARY_MISMATCH as CANARY_MISMATCH
from supervisor.quality.answers import DEGRADED_REASONS as DEGRADED_REASONS
from supervisor.quality.answers import DISABLED as DISABLED
from supervisor.quality.answers import LEARNED as LEARNED
from supervisor.quality.answers import MARGIN_FLOOR as MARGIN_FLOOR
from supervisor.quality.answers import MATCHED as MATCHED
from supervisor.quality.answers import MIN_CHECKED as MIN_CHECKED
from supervisor.quality.answers import MISMATCH as MISMATCH
from supervisor.quality.answers import NO_CUDA_GRAPH as NO_CUDA_GRAPH
from supervisor.quality.answers import SLOW_DECODE as SLOW_DECODE
from supervisor.quality.answers import SPEC_COLLAPSE as SPEC_COLLAPSE
from supervisor.quality.answers import UNKNOWN as UNKNOWN
from supervisor.quality.answers import Answer as Answer
from supervisor.quality.answers import Comparison as Comparison
from supervisor.quality.answers import KnownResult as KnownResult
from supervisor.quality.answers import checked_prefix as checked_prefix
from supervisor.quality.answers import compare as compare
from supervisor.quality.answers import decode_speed as decode_speed
from supervisor.quality.answers import holds as holds
from supervisor.quality.answers import known_tokens as known_tokens
from supervisor.quality.answers import parse_answer as parse_answer
from supervisor.quality.watches import BASELINE_SAMPLES as BASELINE_SAMPLES
from supervisor.quality.watches import GRAPH_COUNT as GRAPH_COUNT
from supervisor.quality.watches import GRAPH_DEVICES as GRAPH_DEVICES
from supervisor.quality.watches import GRAPH_MAX_RUNNING as GRAPH_MAX_RUNNING
from supervisor.quality.watches import RECOVER_RATIO as RECOVER_RATIO
from supervisor.quality.watches import SLOW_COUNT as SLOW_COUNT
from supervisor.quality.watches import SLOW_RATIO as SLOW_RATIO
from supervisor.quality.watches import SPEC_COUNT as SPEC_COUNT
from supervisor.quality.watches import SPEC_GAUGE as SPEC_GAUGE
from supervisor.quality.watches import SPEC_WINDOW as SPEC_WINDOW
from supervisor.quality.watches import GraphWatch as GraphWatch
from supervisor.quality.watches import SpecWatch as SpecWatch
from supervisor.quality.watches import SpeedWatch as SpeedWatch
from supervisor.quality.watches import accept_length as accept_length
from supervisor.quality.watches import decode_graph as decode_graph
from supervisor.quality.watches import parse_gauge as parse_gauge
from supervisor.quality.watches import profile_disables_graphs as profile_disables_graphs
from supervisor.quality.watches import startup_evidence as startup_evidence
