"""The control file beside a running census (native/src/injector/injector.c, control_poll) as a careless or
hostile writer leaves it: too long, starting with a NUL, words with terminal escapes, rewritten in a
loop. One line each, escaped, rate-limited; the census keeps running as it was. Real injector, mock
libcupti (as test_injector.py)."""
from __future__ import annotations

from test_injector import read, run_case

FLUSH_20MS = {"OTEL_GPU_CENSUS_FLUSH_MS": "20"}
WAIT_SEGMENT = """
        import time
        g.InitializeInjection()
        T = 1_700_000_000_000_000_000
        queue(cr.kernel(T, T + 600), cr.KERNEL_T)
        g.gc_flush()                          # the segment, and so the control file's name
        ctl = path()[:-4] + '.control'
        def put(data):
            with open(ctl, 'wb') as f:
                f.write(data)
            time.sleep(0.15)                  # several flusher rounds
"""


def test_a_control_file_too_long_is_refused_in_one_line(native, mock_lib, tmp_path):
    res, err, d = run_case(native, mock_lib, tmp_path, WAIT_SEGMENT + """
        for _ in range(3):                      # over the 127 bytes read: ignored, said once
            put(b'census=off' + b' ' * 200 + b'\\n')
    """, env=FLUSH_20MS)
    assert err.count("\n") == 1 and "ignored (longer than the 127 bytes it reads; census=on|off|finish)" in err, err
    assert not read(native, next(d.glob("*.seg"))).graphs.paused_ns        # never applied


def test_a_control_file_starting_with_a_nul_is_refused_in_one_line(native, mock_lib, tmp_path):
    res, err, d = run_case(native, mock_lib, tmp_path, WAIT_SEGMENT + """
        put(b'\\0census=off\\n')
    """, env=FLUSH_20MS)
    assert err.count("\n") == 1 and "ignored (it holds a NUL byte; census=on|off|finish)" in err, err
    assert not read(native, next(d.glob("*.seg"))).graphs.paused_ns


def test_control_words_with_escape_bytes_are_logged_escaped(native, mock_lib, tmp_path):
    res, err, d = run_case(native, mock_lib, tmp_path, WAIT_SEGMENT + """
        put(b'census=\\x1b]0;owned\\x07\\x1b[2J \\xc3\\xa9t\\xc3\\xa9\\n')
    """, env=FLUSH_20MS)
    assert "\x1b" not in err and "\x07" not in err and err.count("\n") == 1, repr(err)
    assert 'ignoring "census=\\x1b]0;owned\\x07\\x1b[2J" (census=on|off|finish' in err
    assert '"\\xc3\\xa9t\\xc3\\xa9"' in err


def test_rewrites_with_unknown_words_log_at_most_one_line_every_ten_seconds(native, mock_lib, tmp_path):
    res, err, d = run_case(native, mock_lib, tmp_path, WAIT_SEGMENT + """
        for i in range(40):
            with open(ctl, 'w') as f:
                f.write(f'bogus{i} census=off\\n' if i % 2 else f'bogus{i} census=on\\n')
            time.sleep(0.03)
    """, env=FLUSH_20MS)
    assert err.count("\n") == 1 and 'ignoring "bogus0"' in err, err
