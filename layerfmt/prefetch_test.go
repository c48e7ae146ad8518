package layerfmt

import (
	"errors"
	"slices"
	"testing"
)

func TestFrameList(t *testing.T) {
	for _, tc := range []struct {
		frames []int
		text   string
	}{
		{nil, ""},
		{[]int{3}, "3"},
		{[]int{0, 1, 2, 3, 40, 13, 41, 42}, "0-3,40,13,41-42"},
		{[]int{5, 4, 3}, "5,4,3"},
	} {
		if got := FormatFrameList(tc.frames); got != tc.text {
			t.Errorf("FormatFrameList(%v) = %q, want %q", tc.frames, got, tc.text)
		}
		got, err := ParseFrameList(tc.text, 50)
		if err != nil || !slices.Equal(got, tc.frames) {
			t.Errorf("ParseFrameList(%q) = %v, %v, want %v", tc.text, got, err, tc.frames)
		}
	}
	for _, bad := range []string{"1,1", "0-3,2", "50", "-1", "3-3", "4-2", "a", "1,,2", "01", "+1", "1-", " 1"} {
		if _, err := ParseFrameList(bad, 50); !errors.Is(err, ErrBadPrefetch) {
			t.Errorf("ParseFrameList(%q): %v, want ErrBadPrefetch", bad, err)
		}
	}
}

func FuzzParseFrameList(f *testing.F) {
	f.Add("0-3,40,13,41-42", 50)
	f.Add("7", 8)
	f.Fuzz(func(t *testing.T, s string, n int) {
		n = n & 0xffff
		frames, err := ParseFrameList(s, n)
		if err != nil {
			return
		}
		seen := map[int]bool{}
		for _, k := range frames {
			if k < 0 || k >= n || seen[k] {
				t.Fatalf("ParseFrameList(%q, %d) accepted frame %d", s, n, k)
			}
			seen[k] = true
		}
		again, err := ParseFrameList(FormatFrameList(frames), n)
		if err != nil || !slices.Equal(again, frames) {
			t.Fatalf("round trip of %v: %v, %v", frames, again, err)
		}
	})
}
