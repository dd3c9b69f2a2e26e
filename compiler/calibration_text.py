"""The calibration text `llmc compile --draft-skip N` measures draft acceptance on (compiler/draft.py):
ordinary English prose and a little Python, written for llmc, so no download and no licence
question. A few hundred tokens in a real tokenizer; the first CALIBRATION_TOKENS are read."""

CALIBRATION_TEXT = """\
The library opens at nine in the morning and closes at six in the evening, except on Sundays, when
it stays closed. Most visitors come for the reading room on the second floor, where the windows face
the river and the light is good until late in the afternoon. A small cafe near the entrance sells
coffee, tea and sandwiches; eating is not allowed among the shelves, but a cup with a lid is fine.

To borrow a book, bring it to the front desk with your card. Loans last three weeks and can be
renewed twice online, as long as nobody else has asked for the same title. If a book comes back
late, the fine is small, but the account is blocked until it is paid. Children under twelve need a
parent to sign the form when they get their first card.

Every year in spring the library holds a sale of old books. Prices start at one dollar, and the money
pays for new computers, longer opening hours and the summer reading program for schools.

def merge_sorted(left, right):
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result


def word_counts(text):
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda item: item[1], reverse=True)

Question: What is the capital of France?
Answer: The capital of France is Paris, a city on the Seine known for its museums, its cafes and the
Eiffel Tower, which was built for the world's fair of 1889.
"""
