"""Input-grounded prompts: tasks whose good answer copies much of the prompt.

Speculative decoding by prompt lookup (n-gram speculation: vLLM's ``ngram`` method,
transformers' ``prompt_lookup_num_tokens``) proposes the next few tokens by finding the
last few generated tokens earlier in the prompt and copying what followed them there. It
pays where answers quote their input: rewriting, correcting, summarising or extracting
from a given text. On open-ended chat (``labserver.load.prompts.Questions``) there is
little to copy, most proposals are refused, and the same method gains little or costs
time; so a claim about it needs this workload beside that one.

Each prompt is one of ``TASKS`` (an instruction), a blank line, then one of ``PASSAGES``:
24 short everyday texts (notices, a recipe, letters, instructions, news from made-up
towns), 60 to 120 words each, written for this project (no outside source, no licence
to track). The ``spelling`` task shows its passage with a few mistakes put in by
``misspell`` (deterministic), so its answer is the passage itself; every other task shows
the passage as written.

A payload source like ``Questions``: ``GroundedTasks().take(n, rng)`` gives n prompts,
every (task, passage) pair once before any repeats; ``pairs`` says which pair each came
from, and ``by_task`` splits it into one source per task, for a ``Mix`` of one ``Flow``
per task that labels each answer with its task. It sends nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

__all__ = ["GroundedTasks", "PASSAGES", "TASKS", "misspell"]

TASKS: dict[str, str] = {  # name -> instruction; the answer reuses the passage's own words
    "first-person": "Rewrite the following text in the first person, as if you were the one who wrote or "
                    "lived it, keeping its facts and as many of its words as you can:",
    "spelling": "Copy the following text, correcting its spelling mistakes:",
    "times": "List every sentence of the following text that mentions a time, a date, a day or a number, "
             "word for word:",
    "summary": "Summarise the following text in two or three sentences, using its own words where you can:",
    "facts": "Extract the key facts from the following text as a bulleted list, quoting it:",
    "extend": "Repeat the following text exactly, then add one sentence of your own at the end:",
}

PASSAGES: tuple[str, ...] = (  # the project's own texts, plain ASCII, 60-120 words each
    "The Dunmere Town Museum will close its upper gallery from Monday 3 March to Friday 14 March while the "
    "roof is repaired. The ground floor, the cafe and the gift shop stay open as usual, from 10 am to 5 pm "
    "every day except Tuesday. The model railway, normally kept upstairs, has been moved to the old schoolroom "
    "beside the entrance. School groups who booked a visit to the upper gallery during these two weeks will be "
    "offered a new date. We are sorry for the trouble and thank you for your patience.",

    "Lentil soup for four. Wash 250 grams of red lentils until the water runs clear. Chop one onion, two "
    "carrots and a stick of celery, and fry them gently in a spoon of oil for about ten minutes. Add the "
    "lentils, a tin of chopped tomatoes and one litre of vegetable stock. Bring it to the boil, then turn the "
    "heat down and let it simmer for twenty-five minutes, stirring now and then. Season with salt, pepper and "
    "a squeeze of lemon. Serve it hot with crusty bread.",

    "From Sunday 6 April the number 14 bus will no longer stop at Mill Lane, because the road is being "
    "widened. Please use the temporary stop outside the library instead, about two minutes' walk away. The "
    "first bus of the day now leaves the station at 6:40 am, ten minutes earlier than before, and the last one "
    "leaves at 11:15 pm. On Saturdays the buses run every twenty minutes until 7 pm. The works are expected to "
    "finish by the end of June.",

    "The Brightway desk lamp has a flexible arm that bends in any direction and a heavy base that keeps it "
    "steady. It gives a warm white light with three brightness levels, chosen by tapping the switch on the "
    "base. The lamp uses an LED that lasts for about 25,000 hours, so you should never need to change a bulb. "
    "It comes in black, grey and pale green, and weighs just under one kilogram. A USB port in the base lets "
    "you charge your phone while you work.",

    "To all staff. The monthly team meeting has moved from Thursday to Wednesday 12 June at 2 pm, in the large "
    "meeting room on the second floor. We will go over the new holiday booking system, the plans for the "
    "summer open day and the results of the staff survey. Please read the survey summary, which Karen sent "
    "round on Monday, before you come. If you cannot attend, tell your manager by Tuesday so that someone can "
    "take notes for you. Tea and biscuits will be provided.",

    "The people of Callow Vale woke on Saturday to find the old clock on the market hall working again for the "
    "first time in eleven years. A group of six volunteers, led by retired engineer Tom Baxter, spent most of "
    "the winter cleaning and repairing its brass gears. The work cost just over 3,000 pounds, raised by a bake "
    "sale and a sponsored walk. The clock will be wound by hand every Sunday morning. Mr Baxter said he was "
    "proud of the team and glad to hear the bell again.",

    "Dear Aunt Rosa, thank you so much for the birthday parcel, which arrived on Tuesday. The blue scarf is "
    "lovely and has already kept me warm on two very cold walks to school. Mum says the cake tin is far too "
    "nice to use, but I have told her we must bake something in it this weekend. We are hoping to visit you in "
    "August, probably in the second week, if the train tickets are not too expensive. Please give my love to "
    "Uncle Ben and the dog. With love, Maya.",

    "To make a coffee with the Model 3 machine, first fill the water tank up to the line marked MAX and switch "
    "the machine on at the back. Wait about thirty seconds until the green light stops flashing. Put one "
    "coffee pod in the holder with the foil side facing up and close the lid firmly. Place a cup under the "
    "spout and press the large button once for a short drink or twice for a long one. When you have finished, "
    "open the lid and throw the used pod away.",

    "A child's red bicycle was found outside the Ashby Fen library on the evening of Friday 9 May. It has a "
    "white basket on the front and a small bell shaped like a ladybird. It is now being kept safely in the "
    "library's back office. If it belongs to you, please come to the front desk and describe it to a member of "
    "staff. The library is open from 9 am to 6 pm on weekdays and from 9 am to 1 pm on Saturdays. Anything not "
    "collected within four weeks will be given to charity.",

    "The Riverside swimming pool will be open for family swimming every Saturday and Sunday from 9 am to noon. "
    "Children under eight must be with an adult in the water at all times, and each adult may bring up to two "
    "young children. Floats and armbands can be borrowed free of charge from the poolside. Adult lane swimming "
    "continues on weekday mornings from 6:30 am to 9 am. The pool will be closed on 25 and 26 December and on "
    "1 January. Tickets cost 4 pounds for adults and 2 pounds for children.",

    "This peace lily likes bright light but not direct sun, which can burn its leaves. Water it once a week in "
    "summer and about every ten days in winter, letting the top of the soil dry out between waterings. If the "
    "leaves droop, it is usually thirsty and will recover within a few hours of a drink. Wipe the leaves with a "
    "damp cloth every month to keep them free of dust. Keep the plant away from cats and dogs, as it can make "
    "them ill if they chew it.",

    "Welcome to the Harbour View Guest House. Breakfast is served in the dining room from 7:30 to 9:30 am, and "
    "we are happy to make a packed lunch if you ask the evening before. Please leave your room by 11 am on the "
    "day you go home; your bags can wait in the hall until later. The front door is locked at midnight, and "
    "your room key also opens it. The nearest shop is five minutes' walk down the hill. If you need anything "
    "at all, ring the bell at reception.",

    "Dear parents, on Thursday 15 May Class 4 will visit Green Hill Farm as part of our topic on food and "
    "farming. The coach will leave school at 9 am and return by 3:15 pm. Children should wear old clothes and "
    "boots, and bring a packed lunch and a drink in a bag they can carry themselves. The trip costs 8 pounds, "
    "which should be paid at the school office by Friday 2 May. Please sign and return the permission slip "
    "below. Thank you, Mrs Patel.",

    "Parking in the Station Road car park is free for the first hour. After that it costs 1 pound 50 for each "
    "hour, up to a maximum of 8 pounds a day. Tickets must be shown clearly on the dashboard. Spaces near the "
    "entrance are kept for blue badge holders and for parents with young children. The car park is locked "
    "each night from 10 pm to 6 am, and any car left inside will be released only the next morning. Cars "
    "parked on the yellow lines may be fined.",

    "Tomorrow will start cold and foggy, especially near the river, with the fog slow to clear until about 10 "
    "am. The afternoon should be bright and dry, with highs of around 12 degrees. Clouds will build from the "
    "west in the evening, and light rain is likely after 8 pm. On Friday the rain will turn heavier and a "
    "strong wind will pick up along the coast, so take care if you are driving. The weekend looks settled, "
    "with sunny spells and only a small chance of showers.",

    "A bright two-bedroom flat is available to rent from 1 September on Elm Street, close to the park and the "
    "primary school. It has a large kitchen with a new oven, a bathroom with a shower over the bath, and a "
    "small balcony that gets the sun in the afternoon. Heating is by gas, and the flat is on the third floor of "
    "a building with a lift. The rent is 950 pounds a month, not including bills. Sorry, no pets. To arrange a "
    "viewing, call the office on weekdays.",

    "If you hear the fire alarm, a loud ringing bell, stop what you are doing and leave the building by the "
    "nearest exit. Do not use the lifts and do not stop to collect your belongings. Close doors behind you if "
    "you can. Once outside, go to the meeting point in the car park next to the big oak tree and tell your "
    "floor warden that you are there. Do not go back inside until a warden says it is safe. The alarm is "
    "tested every Monday at 10 am for a few seconds.",

    "The Ellbridge Community Hall will show a free film for families on Saturday 19 October at 4 pm. This "
    "month's choice is a much-loved cartoon about a brave little mouse who sails across the sea to find her "
    "lost brother. Doors open at 3:30 pm, and seats are given out on a first come, first served basis. Popcorn "
    "and juice will be sold at the interval, with all the money going to the new hall roof. Please bring a "
    "cushion, as the chairs are rather hard.",

    "To set up your new router, plug the grey cable into the socket marked DSL and the other end into your "
    "phone line. Connect the power lead and press the button on the side. After about two minutes the light on "
    "the front will turn from orange to white. Your network name and password are printed on the card under "
    "the router. Enter them on your phone or laptop to connect. If the light turns red, switch the router off, "
    "wait one minute and try again.",

    "Greenleaf Bakery is looking for a friendly part-time shop assistant to work three mornings a week, from 7 "
    "am to 1 pm on Mondays, Wednesdays and Fridays. You will serve customers, keep the shelves full and help to "
    "keep the shop clean and tidy. No experience is needed, as full training will be given, but you must be "
    "good with people and happy to start early. The pay is 12 pounds an hour, and you may take home any bread "
    "left at the end of the day. To apply, send a short letter by 30 April.",

    "This is a reminder that you have an appointment with Dr Lewis at the Park Road surgery on Tuesday 8 July "
    "at 9:20 am. Please arrive ten minutes early and give your name at the front desk. Bring a list of any "
    "medicines you are taking, including vitamins. If you need to cancel or change the appointment, please "
    "call us at least 24 hours before, so that someone else can have the time. The surgery car park is small, "
    "so you may wish to walk or come by bus.",

    "From the first week of March, bins in the Northfield area will be collected on Wednesdays instead of "
    "Mondays. The green bin for garden waste will be emptied every two weeks, and the blue box for paper, cans "
    "and bottles every week. Please put your bins out by 7 am on the day of collection and take them back in by "
    "the evening. Glass should be rinsed, and cardboard boxes should be flattened. Bins that are too heavy to "
    "lift, or that have the wrong things in them, will be left behind.",

    "Day one of the walking holiday starts at the Old Bridge Inn at 9:30 am, where your guide, Sam, will meet "
    "the group. The first walk is about twelve kilometres along the river to the village of Lowmoor, with a "
    "stop for lunch at a farm cafe. You should reach your hotel by 5 pm, and dinner is at 7. Your bags will be "
    "carried ahead by van, so you only need a small backpack with water, a rain jacket and snacks. Good "
    "walking boots are a must, as parts of the path can be muddy.",

    "The Dunmere Chess Club meets every Thursday evening from 7 to 9:30 pm in the back room of the Red Lion. "
    "New players of all ages and levels are welcome, and we have spare boards and clocks for anyone who needs "
    "them. On the last Thursday of each month we hold a friendly quick-play tournament, with a small prize for "
    "the winner. This year the club turns forty, and we are planning a party on 21 November. Membership costs "
    "20 pounds a year, and your first three visits are free.",
)

_WORD = re.compile(r"\b[a-z]{5,}\b")  # lower-case words of five letters or more: never a name, number or MAX


def _mistake(word: str, kind: int) -> str:
    """One spelling mistake in ``word``: swap two letters, drop one, or double one (by ``kind`` % 3)."""
    mid = len(word) // 2
    if kind % 3 == 0:  # swap the first unlike pair from the middle on ("kettle" -> "ketlte")
        for j in range(mid, len(word) - 2):
            if word[j] != word[j + 1]:
                return word[:j] + word[j + 1] + word[j] + word[j + 2:]
    if kind % 3 == 1 and len(word) >= 7:  # drop a middle letter; a shorter word could become another ("first")
        return word[:mid] + word[mid + 1:]
    return word[:mid] + word[mid] + word[mid:]  # double a middle letter ("before" -> "befoore")


def misspell(text: str, every: int = 6) -> str:
    """``text`` with a spelling mistake in every ``every``-th lower-case word of five letters or more.

    Deterministic (no randomness: the same text always gets the same mistakes), and only inside
    words, so spaces, punctuation, names and numbers stay as they were; a text with fewer
    than ``every`` such words comes back unchanged.

    >>> misspell("Please remember the kettle should always be switched off before leaving", every=2)
    'Please remember the ketlte should alwaays be switched off befoore leaving'
    """
    if every < 1:
        raise ValueError(f"every must be >= 1 (a mistake in every N-th long word), got {every}")
    seen = 0

    def change(match: re.Match[str]) -> str:
        nonlocal seen
        seen += 1
        return _mistake(match[0], seen // every - 1) if seen % every == 0 else match[0]

    return _WORD.sub(change, text)


@dataclass(frozen=True, eq=False)
class GroundedTasks:
    """Every (task, passage) pair as a prompt, drawn in a seeded order, each once before any repeats."""

    passages: tuple[str, ...] = PASSAGES
    tasks: tuple[str, ...] = tuple(TASKS)  # names of TASKS

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"tasks must be names from TASKS ({', '.join(TASKS)}), got {list(self.tasks)!r}")
        if not self.passages or not all(isinstance(p, str) and p.strip() for p in self.passages):
            raise ValueError("passages must be a non-empty tuple of non-empty texts")

    def pairs(self, n: int, rng: np.random.Generator) -> list[tuple[str, int]]:
        """The (task name, passage index) of each of ``take``'s prompts for the same ``rng`` state."""
        every = [(task, i) for task in self.tasks for i in range(len(self.passages))]
        out: list[tuple[str, int]] = []
        while len(out) < n:
            out += [every[k] for k in rng.permutation(len(every))]
        return out[:n]

    def take(self, n: int, rng: np.random.Generator) -> list[str]:
        return [self.prompt(task, i) for task, i in self.pairs(n, rng)]

    def prompt(self, task: str, passage: int) -> str:
        """Task ``task``'s instruction, a blank line, then passage number ``passage`` (misspelled for ``spelling``)."""
        text = self.passages[passage]
        return f"{TASKS[task]}\n\n{misspell(text) if task == 'spelling' else text}"

    def by_task(self) -> dict[str, GroundedTasks]:
        """One source per task, over the same passages: the payloads of a ``Mix`` with one ``Flow`` per task."""
        return {task: GroundedTasks(self.passages, (task,)) for task in self.tasks}
