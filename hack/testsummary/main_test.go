package main

import (
	"bytes"
	"os"
	"strings"
	"testing"
)

// testdata/failing.json is `go test -json -timeout 5s ./...` of a module
// with a passing, a failing, a hanging test, subtests one of which skips,
// and a package that does not build.
func TestFailingRun(t *testing.T) {
	f, err := os.Open("testdata/failing.json")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out, rec bytes.Buffer
	r := newRun(&out)
	if err := r.read(f, &rec); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"FAIL\tx/b [build failed]",
		"a_test.go:6: why it failed",
		"--- FAIL: TestBad",
		"panic: test timed out after 5s",
		"FAIL\tx/a\t",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	for _, not := range []string{"quiet", "=== RUN", "\nPASS\n"} {
		if strings.Contains(out.String(), not) {
			t.Errorf("output has %q, which go test without -v does not print:\n%s", not, out.String())
		}
	}
	// As without -v: the FAIL line heads what the test logged.
	if strings.Index(out.String(), "--- FAIL: TestBad") > strings.Index(out.String(), "a_test.go:6: why it failed") {
		t.Errorf("log printed before the --- FAIL line:\n%s", out.String())
	}
	// The timeout's panic comes before the package's verdict.
	if strings.Index(out.String(), "panic: test timed out") > strings.Index(out.String(), "FAIL\tx/a\t") {
		t.Errorf("panic printed after the package's FAIL line:\n%s", out.String())
	}
	// TestOK, TestSub, TestSub/s1 passed; TestBad and TestHang failed;
	// x/b failed to build; TestSub/s2 skipped.
	if p, f, s := r.totals(); p != 3 || f != 3 || s != 1 {
		t.Errorf("totals %d passed, %d failed, %d skipped; want 3, 3, 1", p, f, s)
	}

	var rep bytes.Buffer
	r2 := newRun(nil)
	if err := r2.read(&rec, nil); err != nil {
		t.Fatal(err)
	}
	r2.report(&rep)
	lines := strings.Split(strings.TrimRight(rep.String(), "\n"), "\n")
	if last := lines[len(lines)-1]; last != "3 passed, 3 failed, 1 skipped" {
		t.Errorf("last line %q", last)
	}
	for _, want := range []string{"x/a TestSub/s2: a_test.go:7: no thing", "FAIL x/b", "(package failed: build, panic or timeout)"} {
		if !strings.Contains(rep.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, rep.String())
		}
	}
}
