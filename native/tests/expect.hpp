// EXPECT for the native unit tests: a failed check is printed with its line and
// counted, and the test goes on, so one run lists every failure.
#pragma once

#include <cstdio>

static int failures = 0;

#define EXPECT(cond)                                                                  \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "%s:%d: EXPECT failed: %s\n", __FILE__, __LINE__, #cond); \
            ++failures;                                                               \
        }                                                                             \
    } while (0)

// main's exit status: prints "<what>: all passed" (which the pytest wrapper looks
// for) or the number of failed checks.
static inline int report(const char *what) {
    if (failures) {
        fprintf(stderr, "%d failed\n", failures);
        return 1;
    }
    printf("%s: all passed\n", what);
    return 0;
}
