package layerfmt

import (
	"errors"
	"slices"
	"testing"
)

func TestPrefetchList(t *testing.T) {
	e := func(frame int, at int64) PrefetchEntry { return PrefetchEntry{frame, at} }
	for _, tc := range []struct {
		entries []PrefetchEntry
		text    string
	}{
		{nil, ""},
		{[]PrefetchEntry{e(3, 0)}, "3@0"},
		{[]PrefetchEntry{e(0, 5), e(1, 5), e(2, 6), e(3, 9), e(40, 120), e(13, 121), e(41, 300), e(42, 301)}, "0-3@5,40@120,13@121,41-42@300"},
		{[]PrefetchEntry{e(5, 0), e(4, 1), e(3, 2)}, "5@0,4@1,3@2"},
	} {
		if got := FormatPrefetch(tc.entries); got != tc.text {
			t.Errorf("FormatPrefetch(%v) = %q, want %q", tc.entries, got, tc.text)
		}
		got, err := ParsePrefetch(tc.text, 50)
		if err != nil || len(got) != len(tc.entries) {
			t.Fatalf("ParsePrefetch(%q) = %v, %v", tc.text, got, err)
		}
		for i := range got {
			// A run takes its first frame's time.
			if got[i].Frame != tc.entries[i].Frame || got[i].AtMS > tc.entries[i].AtMS {
				t.Errorf("ParsePrefetch(%q)[%d] = %v, want %v", tc.text, i, got[i], tc.entries[i])
			}
		}
	}
	// Times may be left out (the previous item's, or 0).
	got, err := ParsePrefetch("2,0-1@7,9", 10)
	if want := []PrefetchEntry{e(2, 0), e(0, 7), e(1, 7), e(9, 7)}; err != nil || !slices.Equal(got, want) {
		t.Errorf("untimed items: %v %v, want %v", got, err, want)
	}
	for _, bad := range []string{"1,1", "0-3,2", "50", "-1", "3-3", "4-2", "a", "1,,2", "01", "+1", "1-", " 1", "1@", "1@-3", "1@x", "1@01", "@5"} {
		if _, err := ParsePrefetch(bad, 50); !errors.Is(err, ErrBadPrefetch) {
			t.Errorf("ParsePrefetch(%q): %v, want ErrBadPrefetch", bad, err)
		}
	}
}

func FuzzParsePrefetch(f *testing.F) {
	f.Add("0-3@5,40@120,13@121,41-42@300", 50)
	f.Add("7", 8)
	f.Fuzz(func(t *testing.T, s string, n int) {
		n = n & 0xffff
		entries, err := ParsePrefetch(s, n)
		if err != nil {
			return
		}
		seen := map[int]bool{}
		for _, e := range entries {
			if e.Frame < 0 || e.Frame >= n || seen[e.Frame] || e.AtMS < 0 {
				t.Fatalf("ParsePrefetch(%q, %d) accepted %v", s, n, e)
			}
			seen[e.Frame] = true
		}
		again, err := ParsePrefetch(FormatPrefetch(entries), n)
		if err != nil || len(again) != len(entries) {
			t.Fatalf("round trip of %v: %v, %v", entries, again, err)
		}
		for i := range again {
			if again[i].Frame != entries[i].Frame || again[i].AtMS > entries[i].AtMS {
				t.Fatalf("round trip of %v: %v", entries, again)
			}
		}
	})
}
