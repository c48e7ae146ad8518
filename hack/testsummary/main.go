// Command testsummary turns `go test -json` into what `go test` prints
// without -v, and counts what ran.
//
//	go test -json ./... | testsummary -record FILE
//
// prints each package's result line and the output of failing tests,
// writes the events to FILE, prints a summary of the run and exits 1 if a
// test or a package failed.
//
//	testsummary -report FILE...
//
// prints, per package, how many tests (subtests included) passed, failed
// and were skipped, with every skipped test and its reason, and ends with
// one line "N passed, N failed, N skipped", which CI reads.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// event is one line of `go test -json` (cmd/test2json), with the build
// events of Go 1.24+ (ImportPath, build-output, build-fail).
type event struct {
	Action     string
	Package    string
	Test       string
	Output     string
	ImportPath string
}

type testKey struct{ pkg, test string }

// run accumulates the counts of one or more `go test -json` streams.
type run struct {
	out     io.Writer // human output; nil in report mode
	pkgs    map[string]*pkgCounts
	pending map[testKey][]string // output of tests still running
	skips   map[testKey]string   // last output line before a test's skip
}

type pkgCounts struct {
	passed, failed, skipped int
	failedPkg               bool // the package failed (build, panic, timeout)
	done                    bool
}

func newRun(out io.Writer) *run {
	return &run{out: out, pkgs: map[string]*pkgCounts{}, pending: map[testKey][]string{}, skips: map[testKey]string{}}
}

func (r *run) pkg(name string) *pkgCounts {
	p, ok := r.pkgs[name]
	if !ok {
		p = &pkgCounts{}
		r.pkgs[name] = p
	}
	return p
}

func (r *run) print(s string) {
	if r.out != nil {
		fmt.Fprint(r.out, s)
	}
}

// framing lines are the -v markers test2json needs and `go test` without
// -v does not print.
func framing(line string) bool {
	for _, p := range []string{"=== RUN", "=== PAUSE", "=== CONT", "=== NAME"} {
		if strings.HasPrefix(line, p) {
			return true
		}
	}
	return false
}

func (r *run) add(e event) {
	switch e.Action {
	case "build-output":
		r.print(e.Output)
		return
	case "build-fail":
		// "pkg [pkg.test]" names the test binary of pkg.
		name, _, _ := strings.Cut(e.ImportPath, " ")
		r.pkg(name).failedPkg = true
		return
	}
	if e.Package == "" {
		return
	}
	p := r.pkg(e.Package)
	k := testKey{e.Package, e.Test}
	if e.Test == "" {
		switch e.Action {
		case "output":
			if strings.HasPrefix(e.Output, "FAIL\t") {
				r.flushRunning(e.Package) // before the package's verdict
			}
			if e.Output != "PASS\n" && !framing(e.Output) {
				r.print(e.Output)
			}
		case "fail":
			p.failedPkg, p.done = true, true
			r.flushRunning(e.Package)
		case "pass", "skip":
			p.done = true
		}
		return
	}
	switch e.Action {
	case "run":
		r.pending[k] = nil
	case "output":
		if !framing(e.Output) {
			r.pending[k] = append(r.pending[k], e.Output)
		}
	case "pass":
		p.passed++
		delete(r.pending, k)
	case "fail":
		p.failed++
		r.print(failureText(r.pending[k]))
		delete(r.pending, k)
	case "skip":
		p.skipped++
		r.skips[k] = skipReason(r.pending[k])
		delete(r.pending, k)
	}
}

// flushRunning fails the tests of pkg still running: a panic or a timeout
// ended the test binary under them, and their output says why.
func (r *run) flushRunning(pkg string) {
	keys := make([]testKey, 0)
	for k := range r.pending {
		if k.pkg == pkg {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].test < keys[j].test })
	for _, k := range keys {
		r.print(strings.Join(r.pending[k], ""))
		r.pkg(pkg).failed++
		delete(r.pending, k)
	}
}

// failureText is a failed test's output as go test prints it without -v:
// the "--- FAIL" line first, then what the test logged.
func failureText(lines []string) string {
	var head, rest []string
	for _, l := range lines {
		if strings.HasPrefix(strings.TrimLeft(l, " "), "--- FAIL") && len(head) == 0 {
			head = append(head, l)
			continue
		}
		rest = append(rest, l)
	}
	return strings.Join(append(head, rest...), "")
}

// skipReason is the message t.Skip logged: the last output line before
// the "--- SKIP" line.
func skipReason(lines []string) string {
	var last string
	for _, l := range lines {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "--- SKIP") {
			continue
		}
		last = l
	}
	return last
}

func (r *run) read(in io.Reader, record io.Writer) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &e) != nil {
			// Not an event: go test's own errors (a package that does not
			// exist, flags) pass through.
			r.print(string(line) + "\n")
			continue
		}
		if record != nil {
			if _, err := record.Write(append(line, '\n')); err != nil {
				return fmt.Errorf("record events: %w", err)
			}
		}
		r.add(e)
	}
	return sc.Err()
}

func (r *run) totals() (passed, failed, skipped int) {
	for _, p := range r.pkgs {
		passed += p.passed
		failed += p.failed
		skipped += p.skipped
		if p.failedPkg && p.failed == 0 {
			failed++ // a package that failed without a failing test
		}
	}
	return
}

func (r *run) report(w io.Writer) {
	names := make([]string, 0, len(r.pkgs))
	for n, p := range r.pkgs {
		if p.passed+p.failed+p.skipped > 0 || p.failedPkg {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	fmt.Fprintln(w, "tests per package (subtests included):")
	for _, n := range names {
		p := r.pkgs[n]
		status := "ok  "
		if p.failedPkg || p.failed > 0 {
			status = "FAIL"
		}
		extra := ""
		if p.failedPkg && p.failed == 0 {
			extra = " (package failed: build, panic or timeout)"
		}
		fmt.Fprintf(w, "%s %-55s %4d ran: %4d passed, %3d failed, %3d skipped%s\n",
			status, n, p.passed+p.failed+p.skipped, p.passed, p.failed, p.skipped, extra)
	}
	keys := make([]testKey, 0, len(r.skips))
	for k := range r.skips {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].pkg != keys[j].pkg {
			return keys[i].pkg < keys[j].pkg
		}
		return keys[i].test < keys[j].test
	})
	if len(keys) > 0 {
		fmt.Fprintln(w, "skipped:")
		for _, k := range keys {
			fmt.Fprintf(w, "  %s %s: %s\n", k.pkg, k.test, r.skips[k])
		}
	}
	passed, failed, skipped := r.totals()
	fmt.Fprintf(w, "%d passed, %d failed, %d skipped\n", passed, failed, skipped)
}

func main() {
	record := flag.String("record", "", "read go test -json from stdin, print it as go test would, and write the events to this file")
	reportMode := flag.Bool("report", false, "print the summary of the event files given as arguments")
	flag.Parse()
	if err := run1(*record, *reportMode, flag.Args()); err != nil {
		fmt.Fprintf(os.Stderr, "testsummary: %v\n", err)
		os.Exit(2)
	}
}

func run1(record string, reportMode bool, files []string) error {
	if reportMode {
		r := newRun(nil)
		for _, f := range files {
			in, err := os.Open(f)
			if err != nil {
				return err
			}
			err = r.read(in, nil)
			in.Close()
			if err != nil {
				return fmt.Errorf("%s: %w", f, err)
			}
		}
		r.report(os.Stdout)
		if _, failed, _ := r.totals(); failed > 0 {
			os.Exit(1)
		}
		return nil
	}
	if record == "" {
		return fmt.Errorf("need -record FILE or -report FILE...")
	}
	f, err := os.Create(record)
	if err != nil {
		return err
	}
	defer f.Close()
	r := newRun(os.Stdout)
	if err := r.read(os.Stdin, f); err != nil {
		return err
	}
	passed, failed, skipped := r.totals()
	fmt.Printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped)
	if failed > 0 {
		f.Close()
		os.Exit(1)
	}
	return nil
}
