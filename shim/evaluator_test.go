//go:build linux

package shim

import (
	"slices"
	"testing"
)

func TestSplitLowers(t *testing.T) {
	// overlay order: topmost first; positions count from the lowest.
	lowers := []string{"/l/mutation", "/l/eval2", "/l/eval1", "/l/task", "/l/base"}
	for _, tc := range []struct {
		v          string
		held, rest []string
		wantErr    bool
	}{
		{"2-3", []string{"/l/eval2", "/l/eval1"}, []string{"/l/mutation", "/l/task", "/l/base"}, false},
		{"4", []string{"/l/mutation"}, []string{"/l/eval2", "/l/eval1", "/l/task", "/l/base"}, false},
		{"0", []string{"/l/base"}, []string{"/l/mutation", "/l/eval2", "/l/eval1", "/l/task"}, false},
		{"5", nil, nil, true},
		{"0-4", nil, nil, true},
		{"3-2", nil, nil, true},
		{"-1", nil, nil, true},
		{"x", nil, nil, true},
		{"", nil, nil, true},
	} {
		lo, hi, err := parseLayerRange(tc.v)
		var held, rest []string
		if err == nil {
			held, rest, err = splitLowers(lowers, lo, hi)
		}
		if (err != nil) != tc.wantErr || !slices.Equal(held, tc.held) || !slices.Equal(rest, tc.rest) {
			t.Errorf("%q: held %v rest %v err %v", tc.v, held, rest, err)
		}
	}
}

func FuzzParseLayerRange(f *testing.F) {
	for _, s := range []string{"2", "2-3", "0-0", "-", "9999999999999999999", "1-", "-1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		lo, hi, err := parseLayerRange(v)
		if err == nil && (lo < 0 || hi < lo) {
			t.Fatalf("%q parsed to %d-%d", v, lo, hi)
		}
	})
}
